"""Advantage estimators, registered by name (``algorithm.advantage``).

All take time-major tensors: ``rewards``, ``values``, ``dones`` of shape ``[T, B]``
and ``next_value[B]`` (value of the observation after the last step), and return
``(advantages[T, B], returns[T, B])``. ``dones[t]`` marks that the episode ended
*at* step ``t`` (terminated or truncated; time-limit bootstrapping is folded into
the reward by the rollout worker).
"""

from __future__ import annotations

import torch

from embodied.registry import Registry

ADVANTAGES = Registry("advantage estimator (algorithm.advantage)")


@ADVANTAGES.register("gae")
def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
        gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016)."""
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        not_done = (~dones[t].bool()).to(rewards.dtype)
        following = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * following * not_done - values[t]
        running = delta + gamma * gae_lambda * not_done * running
        advantages[t] = running
    return advantages, advantages + values
