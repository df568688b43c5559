"""MLP actor-critic for flat observations: ``obs["state"]: float32[B, D]`` (and a one-hot ``obs["task"]``)."""

from __future__ import annotations

import torch

from policies.base import POLICIES, GaussianActorCritic, mlp, vector_dim, vector_obs


@POLICIES.register("mlp")
class MLPActorCritic(GaussianActorCritic):
    """Separate actor and critic MLPs (sharing features hurts PPO on state tasks)."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(action_dim, cfg.net.log_std_init)
        state_dim = vector_dim(obs_spec)
        hidden = list(cfg.net.hidden_sizes)
        self.actor = mlp([state_dim, *hidden, action_dim], cfg.net.activation, out_gain=0.01 * 2**0.5)
        self.critic = mlp([state_dim, *hidden, 1], cfg.net.activation, out_gain=1.0)

    def actor_mean(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.actor(vector_obs(obs))

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.critic(vector_obs(obs)).squeeze(-1)
