"""The policy protocol: a Gaussian actor-critic on a dict of batched observations.

``act(obs)`` -> ``(actions[B, A], log_prob[B], value[B])``
``evaluate(obs, actions[B, A])`` -> ``(log_prob[B], entropy[B], value[B])``
``value(obs)`` -> ``value[B]``
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU}


def layer_init(layer: nn.Linear | nn.Conv2d, gain: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal weights, zero bias: the PPO default that keeps early updates stable."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp(sizes: list[int], activation: str, out_gain: float | None = None) -> nn.Sequential:
    """Linear layers of ``sizes`` with activations between; last layer gets ``out_gain``."""
    if activation not in ACTIVATIONS:
        from embodied.errors import unknown_name_error

        raise unknown_name_error("activation (policy.activation)", activation, list(ACTIVATIONS))
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        last = i == len(sizes) - 2
        layers.append(layer_init(nn.Linear(a, b), out_gain if last and out_gain is not None else math.sqrt(2)))
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class GaussianActorCritic(nn.Module):
    """Base class: subclasses define ``actor_mean(obs)`` and ``value(obs)``."""

    def __init__(self, action_dim: int, log_std_init: float):
        super().__init__()
        self.action_dim = action_dim
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def actor_mean(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def distribution(self, obs: dict[str, torch.Tensor]) -> Normal:
        mean = self.actor_mean(obs)
        return Normal(mean, self.log_std.expand_as(mean).exp())

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False):
        dist = self.distribution(obs)
        actions = dist.mean if deterministic else dist.sample()
        return actions, dist.log_prob(actions).sum(-1), self.value(obs)

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        dist = self.distribution(obs)
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.value(obs)
