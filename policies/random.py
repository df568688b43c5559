"""Uniformly random actions in the action box [-1, 1]^A: the baseline an evaluation protocol
is checked with (LIBERO: 0% success). It has nothing to train."""

from __future__ import annotations

import math

import torch

from policies.base import POLICIES, GaussianActorCritic


@POLICIES.register("random")
class RandomPolicy(GaussianActorCritic):
    """``act`` ignores the observation and ``deterministic``: a random policy has no mean action.

    Given the rollout worker's standard-normal ``noise [B, A]``, the actions are
    ``2 * Phi(noise) - 1`` (uniform, and as reproducible as any policy's samples).
    """

    trainable = False
    critic_modules = ()

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(action_dim, cfg.net.log_std_init)  # log_std: an unused parameter, so weight sync has one

    @staticmethod
    def _batch(obs: dict[str, torch.Tensor]) -> int:
        return next(iter(obs.values())).shape[0]

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros(self._batch(obs))

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        shape = (self._batch(obs), self.action_dim)
        noise = torch.randn(shape) if noise is None else noise
        actions = 2 * torch.special.ndtr(noise) - 1
        logprob = torch.full((shape[0],), -self.action_dim * math.log(2.0))  # density 2^-A on the box
        return actions, logprob, self.value(obs)

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        raise NotImplementedError("policy=random has nothing to train")
