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
    """``T`` decisions of ``B`` envs, time-major, as PPO trains on them.

    ``obs``: ``[T, B, ...]`` per key; ``actions``: ``[T, B, A]`` (what the policy scored, before
    ``to_env``); ``logprobs``: float ``[T, B]``, or ``[T, B, tokens]`` for token policies (one per
    action token); ``values`` / ``rewards``: float ``[T, B]``; ``dones``: bool
    ``[T, B]`` (the episode ended at this step); ``next_value``: ``[B]``, the value of the
    observation after the last step.
    """

    obs: Obs
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor
    next_value: torch.Tensor

    @property
    def steps(self) -> int:
        return self.actions.shape[0]

    @property
    def num_envs(self) -> int:
        return self.actions.shape[1]

    def map(self, per_step: Callable[[torch.Tensor], torch.Tensor],
            per_env: Callable[[torch.Tensor], torch.Tensor] | None = None, obs: bool = True) -> Trajectory:
        """``per_step`` applied to every ``[T, B, ...]`` field (``obs`` too, unless ``obs=False``:
        then none) and ``per_env`` (default ``per_step``) to ``next_value [B]``."""
        steps = {f.name: per_step(getattr(self, f.name)) for f in fields(self) if f.name not in ("obs", "next_value")}
        return Trajectory(obs={k: per_step(v) for k, v in self.obs.items()} if obs else {},
                          next_value=(per_env or per_step)(self.next_value), **steps)

    def envs(self, which: slice) -> Trajectory:
        """The envs ``which`` (of the ``B``) of every field."""
        return self.map(lambda x: x[:, which], lambda x: x[which])

    def to(self, device) -> Trajectory:
        return self.map(lambda x: x.to(device))

    @classmethod
    def concat(cls, parts: list[Trajectory]) -> Trajectory:
        """Join trajectories of the same ``T`` along the env axis, in order."""
        if len(parts) == 1:
            return parts[0]
        joined = {f.name: torch.cat([getattr(p, f.name) for p in parts], dim=1)
                  for f in fields(cls) if f.name not in ("obs", "next_value")}
        return cls(obs={k: torch.cat([p.obs[k] for p in parts], dim=1) for k in parts[0].obs},
                   next_value=torch.cat([p.next_value for p in parts]), **joined)


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
