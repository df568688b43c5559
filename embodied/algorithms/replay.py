"""Transitions and the replay buffer off-policy algorithms (SAC) train from.

:func:`transitions` turns a rollout worker's :class:`~envs.messages.Trajectory` (``[T, B]``,
collected with next observations) into flat ``(s, a, R, s', discount)`` samples, n-step returns
included; :class:`ReplayBuffer` keeps the newest ``capacity`` of them, preallocated on the
actor's device, and samples batches from a seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from embodied.allocation import allocations_are_config_errors
from envs.base import Obs
from envs.registry import GiB

if TYPE_CHECKING:
    from envs.demos import Demos
from envs.messages import Trajectory


@dataclass
class Transitions:
    """``N`` transitions. ``obs`` / ``next_obs``: ``[N, ...]`` per key; ``actions``: ``[N, A]``;
    ``rewards``: ``[N]`` (the n-step discounted sum); ``discounts``: ``[N]``, what multiplies the
    value of ``next_obs`` in the target (``gamma^k`` after ``k`` steps, 0 where the episode reached
    a terminal state)."""

    obs: Obs
    actions: torch.Tensor
    rewards: torch.Tensor
    next_obs: Obs
    discounts: torch.Tensor

    def __len__(self) -> int:
        return self.actions.shape[0]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Transitions:
        """``fn`` applied to every tensor (each ``[N, ...]``)."""
        return Transitions({k: fn(v) for k, v in self.obs.items()}, fn(self.actions), fn(self.rewards),
                           {k: fn(v) for k, v in self.next_obs.items()}, fn(self.discounts))

    def take(self, idx: torch.Tensor) -> Transitions:
        return self.map(lambda x: x[idx])

    @classmethod
    def cat(cls, parts: list[Transitions]) -> Transitions:
        def joined(name: str):
            first = getattr(parts[0], name)
            if isinstance(first, dict):
                return {k: torch.cat([getattr(p, name)[k] for p in parts]) for k in first}
            return torch.cat([getattr(p, name) for p in parts])

        return cls(**{f.name: joined(f.name) for f in fields(cls)})


def transitions(batch: Trajectory, gamma: float, n_step: int, bootstraps: torch.Tensor) -> Transitions:
    """The ``T * B`` transitions of ``batch`` (time-major: step ``t`` of env ``b`` is sample ``t * B + b``).

    ``bootstraps [T, B]`` (bool): whether the target may add the value of the step's next
    observation (everywhere an episode goes on; where it ended, as the algorithm's bootstrap rule
    says: a time limit is not a terminal state). With ``n_step`` > 1 each sample sums the rewards of
    up to ``n_step`` steps, stopping early where its episode ends or the rollout does (the last
    step of a rollout has no later step here), and bootstraps from the last step's next
    observation with ``gamma`` to the power of the steps summed.
    """
    steps, envs = batch.rewards.shape
    rewards = torch.zeros(steps, envs, dtype=batch.rewards.dtype, device=batch.rewards.device)
    last = torch.zeros(steps, envs, dtype=torch.long, device=batch.rewards.device)  # the step each sample ends on
    for t in range(steps):
        going = torch.ones(envs, dtype=torch.bool, device=rewards.device)
        for k in range(min(n_step, steps - t)):
            rewards[t] += torch.where(going, gamma**k * batch.rewards[t + k], 0.0)
            last[t] = torch.where(going, t + k, last[t])
            going = going & ~batch.dones[t + k]
    env = torch.arange(envs, device=rewards.device).expand(steps, envs)
    summed = (last - torch.arange(steps, device=rewards.device)[:, None] + 1).to(rewards.dtype)
    discounts = gamma**summed * bootstraps[last, env].to(rewards.dtype)
    return Transitions({k: v.flatten(0, 1) for k, v in batch.obs.items()}, batch.actions.flatten(0, 1),
                       rewards.flatten(), {k: v[last, env].flatten(0, 1) for k, v in batch.next_obs.items()},
                       discounts.flatten())


def demo_transitions(demos: Demos, gamma: float, bootstraps_terminal: bool) -> Transitions:
    """One-step transitions of motion-planner demos (envs/demos.py), as training would have collected
    them: each demo up to the step that first solves the task, where its episode terminates (the
    target bootstraps there only if ``bootstraps_terminal``: ``algorithm.bootstrap=all_ends``)."""
    keep = torch.zeros(len(demos), dtype=torch.bool)
    for episode in demos.episode.unique():
        steps = (demos.episode == episode).nonzero().squeeze(1)
        solved = demos.success[steps].nonzero()
        keep[steps[: int(solved[0]) + 1 if len(solved) else len(steps)]] = True
    terminal = demos.success & keep
    discounts = gamma * (~terminal | bootstraps_terminal).float()
    return Transitions({k: v[keep] for k, v in demos.obs.items()}, demos.actions[keep].float(), demos.rewards[keep],
                       {k: v[keep] for k, v in demos.next_obs.items()}, discounts[keep])


class ReplayBuffer:
    """The newest ``capacity`` transitions, in tensors allocated whole at the first :meth:`add`
    (on the device of what is added: the actor's), written round-robin. An allocation that fails is an
    :class:`~embodied.allocation.AllocationUserError` (a configuration error, never retried) naming ``setting``,
    the config key that sets ``capacity``."""

    def __init__(self, capacity: int, setting: str = "the replay buffer's capacity"):
        self.capacity = capacity
        self.setting = setting
        self.storage: Transitions | None = None
        self.size = 0  # transitions held
        self.position = 0  # where the next one is written
        self.added = 0  # transitions ever added

    def __len__(self) -> int:
        return self.size

    @staticmethod
    def bytes_for(capacity: int, obs_spec: dict, action_dim: int) -> int:
        """Memory a full buffer takes for observations ``obs_spec`` (name -> (shape, dtype))."""
        def nbytes(shape, dtype) -> int:
            return torch.empty((), dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size() * int(
                torch.Size(shape).numel())

        per_obs = sum(nbytes(shape, dtype) for shape, dtype in obs_spec.values())
        return capacity * (2 * per_obs + 4 * action_dim + 4 + 4)

    def add(self, new: Transitions) -> None:
        """Write ``new``; past ``capacity``, over the oldest (of ``new`` itself too, if it is longer)."""
        if self.storage is None:
            self.storage = self._allocate(new)
        self.added += len(new)
        if len(new) > self.capacity:
            new = new.take(torch.arange(len(new) - self.capacity, len(new)))
        where = (self.position + torch.arange(len(new))) % self.capacity
        _write(self.storage, where.to(new.actions.device), new)
        self.position = (self.position + len(new)) % self.capacity
        self.size = min(self.size + len(new), self.capacity)

    def _allocate(self, like: Transitions) -> Transitions:
        """Zeroed storage of ``capacity`` rows shaped like ``like``'s, on its device."""
        per_row = sum(x[0].numel() * x.element_size() for x in
                      [like.actions, like.rewards, like.discounts, *like.obs.values(), *like.next_obs.values()])
        what = (f"The replay buffer ({self.setting}={self.capacity:,} transitions of {per_row:,} bytes: "
                f"{self.capacity * per_row / GiB:,.1f} GiB on {like.actions.device})")
        with allocations_are_config_errors(what, self.setting):
            return like.map(lambda x: x.new_zeros((self.capacity, *x.shape[1:])))

    def sample(self, n: int, generator: torch.Generator) -> Transitions:
        """``n`` transitions drawn uniformly with replacement; the indices come from ``generator``
        (a CPU one), so the same generator state draws the same batch."""
        idx = torch.randint(self.size, (n,), generator=generator)
        return self.storage.take(idx.to(self.storage.actions.device))

    def to(self, device: torch.device | str) -> None:
        """Keep the storage on ``device`` from now on."""
        if self.storage is not None and self.storage.actions.device != torch.device(device):
            self.storage = self.storage.map(lambda x: x.to(device))

    def state_dict(self) -> dict:
        """The held transitions (only those: a half-empty buffer saves half) and where writing goes on."""
        held = None if self.storage is None else self.storage.take(torch.arange(self.size)).map(lambda x: x.cpu())
        return {"capacity": self.capacity, "size": self.size, "position": self.position, "added": self.added,
                "held": held}

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(f"a replay buffer of {state['capacity']} transitions cannot be loaded into one of "
                             f"{self.capacity}")
        self.storage, self.size, self.position, self.added = None, 0, 0, 0
        if state["held"] is not None:
            held = state["held"].map(lambda x: x.to(device))
            self.storage = self._allocate(held)
            _write(self.storage, torch.arange(state["size"], device=held.actions.device), held)
        self.size, self.position, self.added = state["size"], state["position"], state["added"]


def _write(storage: Transitions, where: torch.Tensor, new: Transitions) -> None:
    """``storage``'s rows ``where`` = ``new``'s, field by field."""
    for name in ("actions", "rewards", "discounts"):
        getattr(storage, name)[where] = getattr(new, name)
    for name in ("obs", "next_obs"):
        for k, v in getattr(new, name).items():
            getattr(storage, name)[k][where] = v
