"""The batched environment protocol every simulator backend implements.

Shapes use ``B`` for the number of parallel environments. All tensors are torch,
on ``VecEnv.device``.

``reset(seed)`` -> ``(obs, info)``
``step(actions[B, A])`` -> :class:`StepResult`

Observations are a dict of tensors, e.g. ``{"state": float32[B, D]}`` or
``{"rgb": uint8[B, H, W, 3], "state": float32[B, D]}``. A language instruction travels as
``instruction``: uint8 ``[B, L]``, UTF-8 bytes zero-padded to the env's width ``L`` (a multiple of
64, at least 128, wide enough for every instruction the env can show: :func:`instruction_width`);
:func:`decode_instruction` reads a row back.

Environments auto-reset: when env ``i`` finishes an episode (terminated or
truncated), ``obs[i]`` is already the first observation of its next episode, the
last observation of the finished one is in ``info["final_obs"]`` and the
finished episode's statistics are in ``info["episode"]`` (rows valid where
``done``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from envs.seeds import AutoResets

Obs = dict[str, torch.Tensor]
# The instruction field is the env's widest instruction rounded up, never narrower than
# INSTRUCTION_BYTES: every published suite fits that (LIBERO's longest has 88 bytes), so their
# observations, recorded demos and fixtures keep the width 128 they always had.
INSTRUCTION_BYTES = 128
INSTRUCTION_ALIGN = 64  # widths grow in steps of this, so similar instruction sets share a shape


def instruction_width(texts: Iterable[str]) -> int:
    """The field width (bytes) that holds every one of ``texts``: the longest UTF-8 encoding
    rounded up to a multiple of ``INSTRUCTION_ALIGN``, at least ``INSTRUCTION_BYTES``."""
    longest = max((len(text.encode()) for text in texts), default=0)
    return max(INSTRUCTION_BYTES, -(-longest // INSTRUCTION_ALIGN) * INSTRUCTION_ALIGN)


def encode_instruction(text: str, width: int | None = None) -> np.ndarray:
    """A language instruction as an observation: its UTF-8 bytes, zero-padded, uint8 ``[width]``.
    ``width`` None: just wide enough for ``text`` (:func:`instruction_width`). An env passes the
    width of all the instructions it can show, so its observations keep one shape. A text that
    does not fit raises: a cut instruction would be a different prompt."""
    data = text.encode()
    if b"\0" in data:  # zero bytes are the padding: the text would not come back whole
        raise ValueError(f"instruction {text!r} contains a NUL character")
    width = instruction_width([text]) if width is None else width
    if len(data) > width:
        raise ValueError(f"instruction of {len(data)} UTF-8 bytes does not fit an instruction field of "
                         f"{width} bytes: {text!r}")
    out = np.zeros(width, dtype=np.uint8)
    out[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def encode_instructions(texts: Sequence[str]) -> np.ndarray:
    """Several instructions as rows of one width (:func:`instruction_width` of all of them):
    uint8 ``[len(texts), width]``."""
    width = instruction_width(texts)
    return np.stack([encode_instruction(text, width) for text in texts])


def decode_instruction(row) -> str:
    """``obs["instruction"][i]`` (numpy or torch uint8 ``[width]``) -> the text (strict UTF-8)."""
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
