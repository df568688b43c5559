"""What a training algorithm is to the rest of the code: one object per run, built from
``cfg.algorithm`` by :func:`embodied.algorithms.registry.make_algorithm`.

The runner, the config checks, the auto-placement profiler and the actor workers ask the
algorithm object, never its name: whether an iteration collects whole episodes, how many envs
share an initial state, the rules it puts on a run's config, its optimizer and its update. A new
algorithm is a subclass in a file of its own, registered with ``@ALGORITHMS.register(name)``,
plus ``configs/algorithm/<name>.yaml`` (which sets ``name: <name>``) and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from envs.common import Registry
from envs.messages import Trajectory
from scheduler.runtime.data_parallel import SINGLE, DataParallel

ALGORITHMS = Registry("algorithm (algorithm.name; configs/algorithm/ sets it)")

# which finished episodes get their final observation's value added to the last reward (algorithm.bootstrap)
BOOTSTRAP_MASKS = Registry("bootstrap rule (algorithm.bootstrap)")
BOOTSTRAP_MASKS.update({
    "all_ends": lambda terminated, truncated: terminated | truncated,
    "time_limit": lambda terminated, truncated: truncated & ~terminated,
    "none": lambda terminated, truncated: torch.zeros_like(terminated),
})


@dataclass(frozen=True)
class Collection:
    """What the rollout workers keep of each step for an algorithm's update (the fields of the
    :class:`~envs.messages.Trajectory` they send; embodied/workers/recorder.py keeps them).

    - ``bootstrap`` (a ``BOOTSTRAP_MASKS`` name) and ``gamma``: where an episode was cut (by the
      rule), add ``gamma * V(final observation)`` to its last reward, so that an on-policy
      critic's returns carry past the reset. ``"none"``: rewards as the env gave them.
    - ``next_obs``: keep the observation each step led to (the final one where an episode ended)
      and ``terminated`` apart from the time limits, for a critic that bootstraps from them itself
      (off-policy); rewards are then never bootstrapped by the rollout workers.
    """

    bootstrap: str = "none"
    gamma: float = 1.0
    next_obs: bool = False

    def __post_init__(self):
        if self.next_obs and self.bootstrap != "none":
            raise ValueError("a collection that keeps next observations leaves bootstrapping to the critic: "
                             "bootstrap must be 'none'")


class Algorithm:
    """A training algorithm over the rollout workers' :class:`~envs.messages.Trajectory` batches.

    Class attributes a subclass sets:

    - ``episodic``: every iteration resets the envs (``group_size`` envs per initial state) and
      collects whole episodes, which the update scores by their outcome; otherwise rollouts of
      ``algorithm.rollout_steps`` continue the episodes of the iteration before;
    - ``nothing_trained``: why an update may find no sample to train on (shown on the console
      when one does); empty if it cannot happen;
    - ``off_policy``: it learns from data older weights collected, so rollouts may run while it
      updates (``runner.collection=async``);
    - ``max_actor_ranks``: the most data-parallel actor ranks it trains on (None: any).
    """

    episodic: ClassVar[bool] = False
    nothing_trained: ClassVar[str] = ""
    # learns from data collected by older weights (a replay buffer): it may collect asynchronously
    off_policy: ClassVar[bool] = False
    max_actor_ranks: ClassVar[int | None] = None

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

    @property
    def collection(self) -> Collection:
        """What the rollout workers keep of each step: by default, as on-policy actor-critics want
        (values, and rewards bootstrapped by ``algorithm.bootstrap`` with ``algorithm.gamma``)."""
        return Collection(bootstrap=self.cfg.bootstrap, gamma=self.cfg.gamma)

    def state_dict(self) -> dict:
        """The algorithm's own training state beyond the policy and its optimizer (target networks,
        a learned temperature, a replay buffer ...), saved with every checkpoint; none by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s output (a resumed run)."""

    def uniform_actions(self, env_steps: int) -> bool:
        """Whether a training rollout that starts ``env_steps`` env steps into the run acts uniformly at
        random in the action box instead of with the policy (off-policy warm-up); never by default."""
        return False

    @property
    def uses_demos(self) -> bool:
        """Whether the update also draws from demonstrations (:meth:`load_demos` gives them first)."""
        return False

    def load_demos(self, demos) -> None:
        """Keep ``demos`` (``embodied.algorithms.replay.Transitions`` on the actor's device) to train on."""
        raise NotImplementedError(f"algorithm={self.name} trains on no demonstrations")

    def describe(self, obs_spec: dict, action_dim: int) -> list[str]:
        """Lines for the run log about what the algorithm holds beside the policy (a replay buffer's
        memory); none by default. ``obs_spec``: the env's observations (name -> (shape, dtype))."""
        return []

    def resident_mib(self, obs_spec: dict, action_dim: int) -> float:
        """MiB the algorithm keeps on the actor's device beside the policy and its optimizer, at its
        largest (a full replay buffer); auto placement adds it to the actor's memory. Nothing by default."""
        return 0.0

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
