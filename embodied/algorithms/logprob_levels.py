"""What one PPO ratio covers: log-probs grouped by ``algorithm.logprob_level``.

Token policies (VLAs) score every action token: their log-probs are ``[N, T]`` with ``T =
chunk_size * action_dim`` tokens per decision. A level sums them into ``[N, G]`` units, each
with its own ratio and clip: ``token`` (``G = T``), ``action`` (``G = chunk_size``, the sum
over an action's ``action_dim`` tokens) or ``chunk`` (``G = 1``). Every level keeps the total:
summing a level's units gives the chunk's log-prob. A policy whose log-prob is one number per
sample (``[N]``, a Gaussian action) is one unit at every level.
"""

from __future__ import annotations

import torch

from envs.common import Registry

LOGPROB_LEVELS = Registry("log-prob level (algorithm.logprob_level)")


@LOGPROB_LEVELS.register("token")
def token_level(logprob: torch.Tensor, action_dim: int) -> torch.Tensor:
    return logprob


@LOGPROB_LEVELS.register("action")
def action_level(logprob: torch.Tensor, action_dim: int) -> torch.Tensor:
    return logprob.unflatten(-1, (-1, action_dim)).sum(-1)


@LOGPROB_LEVELS.register("chunk")
def chunk_level(logprob: torch.Tensor, action_dim: int) -> torch.Tensor:
    return logprob.sum(-1, keepdim=True)


def group_logprobs(logprob: torch.Tensor, level: str, action_dim: int) -> torch.Tensor:
    """``[N]`` or token log-probs ``[N, T]`` -> the level's units ``[N, G]``."""
    if logprob.dim() == 1:
        return logprob.unsqueeze(-1)
    return LOGPROB_LEVELS.get(level)(logprob, action_dim)
