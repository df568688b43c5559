"""What a training algorithm is to the rest of the code: one object per run, built from
``cfg.algorithm`` by :func:`embodied.algorithms.registry.make_algorithm`.

The runner, the config checks, the auto-placement profiler and the actor workers ask the
algorithm object, never its name: whether an iteration collects whole episodes, how many envs
share an initial state, the rules it puts on a run's config, its optimizer and its update. A new
algorithm is a subclass in a file of its own, registered with ``@ALGORITHMS.register(name)``,
plus ``configs/algorithm/<name>.yaml`` (which sets ``name: <name>``) and its tests.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from envs.common import Registry
from envs.messages import Trajectory
from scheduler.runtime.data_parallel import SINGLE, DataParallel

ALGORITHMS = Registry("algorithm (algorithm.name; configs/algorithm/ sets it)")


class Algorithm:
    """A training algorithm over the rollout workers' :class:`~envs.messages.Trajectory` batches.

    Class attributes a subclass sets:

    - ``episodic``: every iteration resets the envs (``group_size`` envs per initial state) and
      collects whole episodes, which the update scores by their outcome; otherwise rollouts of
      ``algorithm.rollout_steps`` continue the episodes of the iteration before;
    - ``nothing_trained``: why an update may find no sample to train on (shown on the console
      when one does); empty if it cannot happen.
    """

    episodic: ClassVar[bool] = False
    nothing_trained: ClassVar[str] = ""

    def __init__(self, cfg):
        """``cfg``: the run's ``AlgorithmConfig`` (embodied/config.py documents its keys)."""
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def group_size(self) -> int:
        """Envs that start from one initial state in a training reset (1: every env its own)."""
        return 1

    @property
    def success_ends_episode(self) -> bool:
        """Whether success ends a training episode when ``env.success_ends_episode`` is null: an
        algorithm that scores an episode's return over the whole horizon keeps it running."""
        return not self.episodic

    def check(self, run_cfg, rollout_only: bool = False) -> None:
        """Raise a :class:`~envs.common.UserError` (naming the fix) for what this algorithm cannot
        train with in ``run_cfg`` (a ``TrainConfig``). ``rollout_only``: the workers will only roll
        out (the auto-placement profiler's probes), so the rules of the update do not apply."""

    def make_optimizer(self, policy: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def update(self, policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, *, iteration: int = 0,
               generator: torch.Generator | None = None, reference: nn.Module | None = None,
               dp: DataParallel = SINGLE) -> dict[str, float]:
        """Train on ``batch`` (this actor rank's envs, ``[T, B, ...]``) at training ``iteration``;
        returns the update's statistics (TensorBoard's ``train/*``). ``reference``: the frozen
        starting policy a KL penalty holds the policy near (``algorithm.kl_coef``); ``dp``: this
        rank's place among data-parallel actor ranks."""
        raise NotImplementedError

    def profiled_update(self, policy: nn.Module, optimizer: torch.optim.Optimizer,
                        batch: Trajectory) -> dict[str, float]:
        """The update auto placement times (scheduler/profiler.py): a steady-state iteration's, not
        a warm-up's."""
        return self.update(policy, optimizer, batch)
