"""The batched environment protocol every simulator backend implements.

Shapes use ``B`` for the number of parallel environments. All tensors are torch,
on ``VecEnv.device``.

``reset(seed)`` -> ``(obs, info)``
``step(actions[B, A])`` -> :class:`StepResult`

Observations are a dict of tensors, e.g. ``{"state": float32[B, D]}`` or
``{"rgb": uint8[B, H, W, 3], "state": float32[B, D]}``.

Environments auto-reset: when env ``i`` finishes an episode (terminated or
truncated), ``obs[i]`` is already the first observation of its next episode, the
last observation of the finished one is in ``info["final_obs"]`` and the
finished episode's statistics are in ``info["episode"]`` (rows valid where
``done``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from envs.seeds import AutoResets

Obs = dict[str, torch.Tensor]
INSTRUCTION_BYTES = 128  # room for a task's language instruction (LIBERO's longest has 87)


def encode_instruction(text: str) -> np.ndarray:
    """A language instruction as an observation: UTF-8 bytes, zero-padded, uint8 ``[INSTRUCTION_BYTES]``."""
    data = text.encode()[:INSTRUCTION_BYTES]
    out = np.zeros(INSTRUCTION_BYTES, dtype=np.uint8)
    out[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def decode_instruction(row) -> str:
    """``obs["instruction"][i]`` (numpy or torch uint8 ``[INSTRUCTION_BYTES]``) -> the text."""
    data = bytes(np.asarray(row, dtype=np.uint8).tolist())
    return data.rstrip(b"\0").decode()


@dataclass
class StepResult:
    """What ``VecEnv.step`` returns.

    ``obs``: dict of ``[B, ...]`` tensors (after auto-reset).
    ``reward``: float32 ``[B]``.
    ``terminated`` / ``truncated``: bool ``[B]``.
    ``info``: ``success`` bool ``[B]`` (success at this step, of the finished
    episode where done), ``final_obs`` (dict of ``[B, ...]``, valid where done) and
    ``episode`` (see :class:`EpisodeTracker`).
    """

    obs: Obs
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    info: dict = field(default_factory=dict)

    @property
    def done(self) -> torch.Tensor:
        return self.terminated | self.truncated


@runtime_checkable
class VecEnv(Protocol):
    num_envs: int
    action_dim: int
    max_episode_steps: int
    obs_spec: dict[str, tuple[tuple[int, ...], torch.dtype]]
    device: torch.device

    def reset(self, seed: int | list[int] | None = None, reconfigure: bool = False,
              auto_resets: AutoResets | None = None) -> tuple[Obs, dict]:
        """``reconfigure``: rebuild the scenes first, so that nothing earlier episodes left in the
        simulator shapes these (evaluation resets); ``auto_resets``: where the episodes the envs
        then start by themselves get their seeds (envs/seeds.py; None: from the reset seeds)."""
        ...

    def step(self, actions: torch.Tensor, observe: bool = True) -> StepResult:
        """``observe=False``: nobody reads this step's ``obs`` (an action chunk's inner steps),
        so a backend may skip building it and return ``{}``; ``final_obs`` stays complete."""
        ...

    def set_ignore_terminations(self, flag: bool) -> None:
        """True: episodes end only at the time limit (fixed-horizon evaluation)."""
        ...

    def close(self) -> None: ...


class EpisodeTracker:
    """Per-env running episode statistics, batched.

    ``success_once``: the episode succeeded at any step.
    ``success_at_end``: it was successful at its last step.
    """

    def __init__(self, num_envs: int):
        self.returns = torch.zeros(num_envs)
        self.lengths = torch.zeros(num_envs, dtype=torch.long)
        self.success_once = torch.zeros(num_envs, dtype=torch.bool)

    def reset(self, mask: torch.Tensor | None = None) -> None:
        """Zero the running statistics of the envs in ``mask`` (all if None)."""
        if mask is None:
            mask = torch.ones_like(self.success_once)
        self.returns[mask] = 0.0
        self.lengths[mask] = 0
        self.success_once[mask] = False

    def update(self, reward: torch.Tensor, success: torch.Tensor, done: torch.Tensor) -> dict:
        """Account for one step; returns the statistics of episodes finished now.

        Returns a dict of ``[B]`` tensors (``return``, ``length``, ``success_once``,
        ``success_at_end``), valid where ``done``; those envs start afresh.
        """
        self.returns += reward.float().cpu()
        self.lengths += 1
        self.success_once |= success.cpu()
        finished = {
            "return": self.returns.clone(),
            "length": self.lengths.clone(),
            "success_once": self.success_once.clone(),
            "success_at_end": success.cpu().clone(),
        }
        self.reset(done.cpu())
        return finished


def episode_rows(episode: dict, done: torch.Tensor, error: torch.Tensor | None = None) -> list[dict]:
    """Turn the batched ``info["episode"]`` of one step into a row per finished episode;
    ``error`` marks episodes ended by a crashed env process."""
    idx = done.nonzero().flatten().tolist()
    return [
        {
            "env": i,
            "error": bool(error[i]) if error is not None else False,
            "return": float(episode["return"][i]),
            "length": int(episode["length"][i]),
            "success_once": bool(episode["success_once"][i]),
            "success_at_end": bool(episode["success_at_end"][i]),
        }
        for i in idx
    ]
