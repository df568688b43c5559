"""A soft actor-critic for flat observations (``policy=mlp_sac``, trained by ``algorithm=sac``):
a tanh-squashed Gaussian actor and an ensemble of Q critics ``Q(s, a)``.

The actor's mean and log std come from one MLP trunk; an action is ``tanh(mean + std * noise)``,
inside the env's ``[-1, 1]`` box without clipping, and its log-density carries the tanh's
change of variables. The critics are ``policy.net.num_q`` MLPs on ``[state, action]`` (with
``policy.net.q_layer_norm``, a LayerNorm after every hidden layer, as RLPD's critics). They
live in the policy (saved, synced and loaded with it); their target copies are the algorithm's
(embodied/algorithms/sac.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from policies.base import (
    ACTIVATIONS,
    POLICIES,
    Linear,
    Policy,
    layer_init,
    mlp,
    rowwise_exact,
    vector_dim,
    vector_obs,
)

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # the actor's log std is squashed into this range (SpinUp, ManiSkill)


def squashed_logprob(pre_tanh: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """Log-density ``[B]`` of ``tanh(pre_tanh)`` (all ``[B, A]``) when ``pre_tanh ~ N(mean, exp(log_std))``:
    the Gaussian's minus ``log(1 - tanh^2)``, written as ``2 * (log 2 - u - softplus(-2u))`` so it
    stays finite where ``tanh`` saturates. Pointwise functions go through ``rowwise_exact``: a row's
    result must not depend on its batch (pipelined rollouts = serial ones)."""
    std = rowwise_exact(torch.exp, log_std)
    gaussian = -0.5 * ((pre_tanh - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    log_det = 2 * (math.log(2.0) - pre_tanh - rowwise_exact(nn.functional.softplus, -2 * pre_tanh))
    return (gaussian - log_det).sum(-1)


class QNetwork(nn.Module):
    """``Q(s, a)``: an MLP on ``[state, action]`` -> ``[B]``; LayerNorm after each hidden layer if asked."""

    def __init__(self, in_dim: int, hidden: list[int], activation: str, layer_norm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip([in_dim, *hidden[:-1]], hidden, strict=True):
            layers += [layer_init(Linear(a, b)), *([nn.LayerNorm(b)] if layer_norm else []), ACTIVATIONS[activation]()]
        layers.append(layer_init(Linear(hidden[-1], 1), gain=1.0))
        self.net = nn.Sequential(*layers)

    def forward(self, state: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([state, actions], dim=-1)).squeeze(-1)


class QEnsemble(nn.Module):
    """``num_q`` independent critics; ``forward(state [B, D], actions [B, A])`` -> ``[num_q, B]``."""

    def __init__(self, num_q: int, in_dim: int, hidden: list[int], activation: str, layer_norm: bool):
        super().__init__()
        self.members = nn.ModuleList(QNetwork(in_dim, hidden, activation, layer_norm) for _ in range(num_q))

    def forward(self, state: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return torch.stack([q(state, actions) for q in self.members])


@POLICIES.register("mlp_sac")
class SquashedGaussianSAC(Policy):
    """What ``algorithm=sac`` trains (``soft_actor_critic``): besides the Policy protocol,

    - ``sample(obs)`` -> ``(actions [B, A], log_prob [B])``, reparameterised (gradients flow
      through the sample to the actor), noise from torch's generator;
    - ``critic(state [B, D], actions [B, A])`` -> ``[num_q, B]`` Q values, and ``critic_input(obs)``
      -> the ``[B, D]`` state it reads.

    ``value`` in a rollout is not used by SAC: ``act`` returns zeros (no critic pass per step).
    """

    soft_actor_critic = True

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        self.action_dim = action_dim
        self.noise_dim = action_dim
        state_dim = vector_dim(obs_spec)
        hidden = list(cfg.net.hidden_sizes)
        self.trunk = mlp([state_dim, *hidden], cfg.net.activation)
        self.trunk.append(ACTIVATIONS[cfg.net.activation]())
        self.mean_head = layer_init(Linear(hidden[-1], action_dim), gain=0.01)
        self.log_std_head = layer_init(Linear(hidden[-1], action_dim), gain=0.01)
        self.critic = QEnsemble(cfg.net.num_q, state_dim + action_dim, hidden, cfg.net.activation, cfg.net.q_layer_norm)

    # -- the actor -----------------------------------------------------------------------------
    def actor_heads(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean [B, A], log_std [B, A])`` of the pre-tanh Gaussian, log std in [LOG_STD_MIN, LOG_STD_MAX]."""
        features = self.trunk(vector_obs(obs))
        squashed = rowwise_exact(torch.tanh, self.log_std_head(features))
        return self.mean_head(features), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (squashed + 1)

    def sample(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.actor_heads(obs)
        pre_tanh = mean + rowwise_exact(torch.exp, log_std) * torch.randn_like(mean)
        return torch.tanh(pre_tanh), squashed_logprob(pre_tanh, mean, log_std)

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        """``tanh(mean)`` (deterministic) or ``tanh(mean + std * noise)``; ``noise [B, A]`` standard normal."""
        mean, log_std = self.actor_heads(obs)
        if deterministic:
            pre_tanh = mean
        else:
            noise = torch.randn_like(mean) if noise is None else noise.to(mean.device)
            pre_tanh = mean + rowwise_exact(torch.exp, log_std) * noise
        zeros = torch.zeros(mean.shape[0], device=mean.device)
        return rowwise_exact(torch.tanh, pre_tanh), squashed_logprob(pre_tanh, mean, log_std), zeros

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Log-density of given squashed ``actions``, an entropy estimate (minus it) and min-Q as the value."""
        mean, log_std = self.actor_heads(obs)
        pre_tanh = torch.atanh(actions.clamp(-1 + 1e-6, 1 - 1e-6))
        logprob = squashed_logprob(pre_tanh, mean, log_std)
        return logprob, -logprob, self.critic(self.critic_input(obs), actions).min(0).values

    # -- the critics ---------------------------------------------------------------------------
    def critic_input(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return vector_obs(obs)

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``min_i Q_i(s, tanh(mean))``: the greedy action's value (a trajectory's ``next_value``)."""
        mean, _ = self.actor_heads(obs)
        return self.critic(self.critic_input(obs), torch.tanh(mean)).min(0).values
