"""What crosses a process boundary between workers, as typed dataclasses (Ray pickles them).

- :class:`EnvSpec`: an env worker tells the driver what its envs look like.
- :class:`StepMessage`: an env worker's micro-batch after a step, sent to its rollout worker.
- :class:`Trajectory`: a rollout worker's time-major record of its envs, sent to the actor.
- :class:`EnvRollout` / :class:`EnvEvaluation`: what an env worker tells the driver after a
  rollout or an evaluation.

Shapes: ``T`` decisions (a chunking policy's chunk is one decision), ``B`` envs, ``A`` the
policy's action size. They live on the ground floor (``envs/``) because every layer reads
them: the profiler (``scheduler/``) builds a trajectory to time an update on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from envs.base import Obs, StepResult


@dataclass(frozen=True)
class EnvSpec:
    """``obs_spec``: observation name -> (shape without the batch, dtype); ``action_dim``: the
    env's action size; ``max_episode_steps``: in decisions (chunks, with action chunking)."""

    obs_spec: dict[str, tuple[tuple[int, ...], torch.dtype]]
    action_dim: int
    max_episode_steps: int


@dataclass
class StepMessage:
    """One micro-batch of ``B`` envs after a step (or after the reset: ``reward`` and the flags
    are None then).

    ``obs``: ``[B, ...]`` per key, after auto-reset; ``reward``: float32 ``[B]``;
    ``terminated`` / ``truncated``: bool ``[B]``; ``final_obs``: the finished episodes' last
    observations (``[B, ...]`` per key, valid where done), None when no episode ended.
    """

    obs: Obs
    reward: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    final_obs: Obs | None = None

    @classmethod
    def of(cls, result: StepResult) -> StepMessage:
        final = result.info["final_obs"] if bool(result.done.any()) else None
        return cls(result.obs, result.reward, result.terminated, result.truncated, final)

    @property
    def done(self) -> torch.Tensor:
        return self.terminated | self.truncated


@dataclass
class Trajectory:
    """``T`` decisions of ``B`` envs, time-major, as the run's algorithm asked the rollout workers
    to keep them (``Algorithm.collection``, embodied/algorithms/base.py).

    Always: ``obs``: ``[T, B, ...]`` per key; ``actions``: ``[T, B, A]`` (what the policy scored,
    before ``to_env``); ``logprobs``: float ``[T, B]``, or ``[T, B, tokens]`` for token policies
    (one per action token); ``values`` / ``rewards``: float ``[T, B]`` (rewards with
    ``gamma * V(final obs)`` added where the collection bootstraps a cut episode); ``dones``:
    bool ``[T, B]`` (the episode ended at this step); ``next_value``: ``[B]``, the value of the
    observation after the last step.

    Kept only when the collection asks for next observations (off-policy critics), else None:
    ``next_obs``: ``[T, B, ...]`` per key, the observation each step led to (where the episode
    ended, its final observation, not the reset's); ``terminated``: bool ``[T, B]``, the episodes
    that reached a terminal state (``dones & ~terminated``: cut by a time limit, to bootstrap).
    """

    obs: Obs
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor
    next_value: torch.Tensor
    next_obs: Obs | None = None
    terminated: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return self.actions.shape[0]

    @property
    def num_envs(self) -> int:
        return self.actions.shape[1]

    def map(self, per_step: Callable[[torch.Tensor], torch.Tensor],
            per_env: Callable[[torch.Tensor], torch.Tensor] | None = None, obs: bool = True) -> Trajectory:
        """``per_step`` applied to every ``[T, B, ...]`` field (``obs`` and ``next_obs`` too, unless
        ``obs=False``: then they are left out) and ``per_env`` (default ``per_step``) to
        ``next_value [B]``. Fields that are None stay None."""
        def each(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else per_step(x)

        def each_obs(o: Obs | None) -> Obs | None:
            return None if o is None or not obs else {k: per_step(v) for k, v in o.items()}

        steps = {f.name: each(getattr(self, f.name)) for f in fields(self) if f.name not in _NOT_PER_STEP}
        return Trajectory(obs=each_obs(self.obs) or {}, next_obs=each_obs(self.next_obs),
                          next_value=(per_env or per_step)(self.next_value), **steps)

    def envs(self, which: slice) -> Trajectory:
        """The envs ``which`` (of the ``B``) of every field."""
        return self.map(lambda x: x[:, which], lambda x: x[which])

    def to(self, device) -> Trajectory:
        return self.map(lambda x: x.to(device))

    @classmethod
    def concat(cls, parts: list[Trajectory]) -> Trajectory:
        """Join trajectories of the same ``T`` (kept the same way) along the env axis, in order."""
        if len(parts) == 1:
            return parts[0]

        def joined(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values, dim=1)

        def joined_obs(name: str) -> Obs | None:
            first = getattr(parts[0], name)
            return None if first is None else {k: torch.cat([getattr(p, name)[k] for p in parts], dim=1)
                                               for k in first}

        return cls(obs=joined_obs("obs"), next_obs=joined_obs("next_obs"),
                   next_value=torch.cat([p.next_value for p in parts]),
                   **{f.name: joined(f.name) for f in fields(cls) if f.name not in _NOT_PER_STEP})


_NOT_PER_STEP = ("obs", "next_obs", "next_value")  # Trajectory fields that are not one [T, B, ...] tensor


@dataclass
class EnvRollout:
    """An env worker's rollout: the ``episodes`` that finished (a row each, ``env`` indexing the
    worker's slice), and its seconds busy stepping and sending (``sim_s``), of which ``env.step``
    alone (``step_s``), and waiting for actions (``wait_s``)."""

    episodes: list[dict]
    sim_s: float
    step_s: float
    wait_s: float


@dataclass
class EnvEvaluation:
    """An env worker's evaluation round: a row per real episode (``seed`` and ``episode`` tagged),
    and the frames of those it filmed (episode id -> ``{"frames", "rewards", "successes"}``)."""

    rows: list[dict]
    videos: dict[int, dict]
