"""Action chunks: a VecEnv that takes ``k`` actions per step and runs them open loop.

VLAs such as OpenVLA-OFT decode ``k`` actions at once (``policy.chunk_size``). The env worker
wraps each of its VecEnvs in :class:`ChunkedVecEnv`, so one decision of the policy is one
step of the wrapper and ``k`` steps of the simulator; the channel carries one message per chunk.

``step(actions [B, k, A])`` -> :class:`StepResult` of the whole chunk:

- ``reward``: the sum of the rewards of the chunk's steps, up to the step that ended the episode;
- ``terminated`` / ``truncated`` / ``info["success"]`` / ``final_obs`` / ``episode`` /
  ``error``: from the step that ended env ``i``'s episode, or the chunk's last step;
- ``obs``: after the chunk's last step;
- ``info["steps"]``: the chunk's own steps' results, in order (videos show every step).

Only the chunk's last step is observed: the inner steps are taken with ``observe=False``, so a
CPU simulator renders its cameras once per decision instead of ``k`` times (tiny OFT on
ManiSkill PushCube from RGB, chunks of 4: evaluation 2.5x faster end to end). Set
``observe_every_step`` where every step's ``obs`` is needed (recording a video).

An env whose episode ends inside a chunk has already been reset by the simulator, and the
chunk's remaining actions play out at the start of its next episode: batched simulators step
every env together. Those steps count towards the next episode (its return and length). Time
limits that are multiples of ``k`` end on a chunk boundary; so do fixed-horizon evaluations.
``max_episode_steps`` is counted in chunks.
"""

from __future__ import annotations

import math

import torch

from envs.base import Obs, StepResult, VecEnv


def episode_decisions(max_episode_steps: int, chunk_size: int) -> int:
    """Decisions (chunks) in an episode of ``max_episode_steps`` simulator steps: the last chunk may be cut short."""
    return math.ceil(max_episode_steps / chunk_size)


class ChunkedVecEnv:
    def __init__(self, env: VecEnv, chunk_size: int):
        self.env, self.chunk_size = env, chunk_size
        self.num_envs, self.action_dim = env.num_envs, env.action_dim
        self.obs_spec, self.device = env.obs_spec, env.device
        self.max_episode_steps = episode_decisions(env.max_episode_steps, chunk_size)
        self.observe_every_step = False

    def reset(self, seed: int | list[int] | None = None, **options) -> tuple[Obs, dict]:
        return self.env.reset(seed=seed, **options)

    def step(self, actions: torch.Tensor) -> StepResult:
        """``actions [B, chunk_size, A]`` -> the chunk's :class:`StepResult`."""
        if actions.dim() != 3 or actions.shape[1] != self.chunk_size:
            raise ValueError(f"expected actions [B, {self.chunk_size}, A], got {tuple(actions.shape)}")
        ended: torch.Tensor | None = None  # envs whose episode ended in an earlier step of this chunk
        reward, steps = None, []
        for j in range(self.chunk_size):
            last = j == self.chunk_size - 1
            result = self.env.step(actions[:, j], observe=last or self.observe_every_step)
            steps.append(result)
            if ended is None:
                reward, merged, ended = result.reward.clone(), result, result.done.clone()
                continue
            live = ~ended
            reward += torch.where(live, result.reward, torch.zeros_like(result.reward))
            merged = _take(merged, result, live)
            ended |= result.done
        merged.obs = result.obs
        merged.reward = reward
        merged.info["steps"] = steps
        return merged

    def set_ignore_terminations(self, flag: bool) -> None:
        self.env.set_ignore_terminations(flag)

    def render(self, env_index: int = 0):
        return self.env.render(env_index)

    def close(self, **kwargs) -> None:
        self.env.close(**kwargs)


def _take(old: StepResult, new: StepResult, live: torch.Tensor) -> StepResult:
    """``old`` with the rows of ``live`` envs replaced by ``new``'s (done flags, success, final
    observations, episode statistics, errors)."""

    def pick(a, b):
        if a is None or b is None:
            return b if a is None else a
        if isinstance(a, dict):
            return {k: pick(a[k], b[k]) for k in a}
        mask = live.to(a.device).view(-1, *([1] * (a.dim() - 1)))
        return torch.where(mask, b, a)

    info = {k: pick(old.info.get(k), new.info.get(k)) for k in ("success", "final_obs", "episode", "error")}
    info = {k: v for k, v in info.items() if v is not None}
    return StepResult(obs=new.obs, reward=new.reward, terminated=pick(old.terminated, new.terminated),
                      truncated=pick(old.truncated, new.truncated), info=info)
