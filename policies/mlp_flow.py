"""``policy=mlp_flow``: a flow-matching action head on an MLP trunk over flat state observations,
with a separate MLP critic: the chain-sampled path (policies/flow_policy.py) from scratch, as
``mlp_tokens`` is the token path's.

- trunk: ``state [B, S]`` -> features ``[B, H]`` (``policy.net.hidden_sizes``, ``activation``);
- velocity net: ``[features, x_t [B, D], time features of t]`` -> ``v [B, D]``, two hidden layers
  of ``H``;
- noise head (Flow-Noise only): the same inputs -> a std in ``[policy.flow.noise_min, noise_max]``;
- critic: ``state`` -> ``[B]`` through its own MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from envs.common import UserError
from policies.base import POLICIES, mlp, rowwise_exact, vector_dim, vector_obs
from policies.flow_policy import FlowMatchingPolicy, time_features

TIME_FEATURES = 16


@POLICIES.register("mlp_flow")
class MLPFlowPolicy(FlowMatchingPolicy):
    config_sections = ("net", "flow")
    trunk_modules = ("trunk",)

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        state_dim = vector_dim(obs_spec)
        if not state_dim:
            raise UserError(f"policy=mlp_flow needs flat state observations; this env gives {sorted(obs_spec)}. Use "
                            "an env with obs_mode: state (e.g. env=maniskill_pushcube).")
        self._setup_flow(cfg, action_dim)
        net = cfg.net
        width = net.hidden_sizes[-1]
        self.trunk = nn.Sequential(mlp([state_dim, *net.hidden_sizes], net.activation), nn.Tanh())
        expert_in = width + self.width + TIME_FEATURES
        self.velocity_net = mlp([expert_in, width, width, self.width], net.activation, out_gain=0.01)
        # Flow-Noise only: no parameters a Flow-SDE update would leave without gradients
        self.noise_net = mlp([expert_in, width, self.width], net.activation, out_gain=0.01) \
            if cfg.flow.method == "noise" else None
        self.critic = mlp([state_dim, *net.hidden_sizes, 1], net.activation, out_gain=1.0)
        self.freeze_trunk(cfg.flow.train)

    def heads(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = vector_obs(obs)
        return self.trunk(x), self.critic(x).squeeze(-1)

    def _expert_input(self, features: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([features, x, time_features(t, TIME_FEATURES)], -1)

    def velocity(self, features: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.velocity_net(self._expert_input(features, x, t))

    def noise_std(self, features: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        squashed = rowwise_exact(torch.sigmoid, self.noise_net(self._expert_input(features, x, t)))
        return self.noise_min + (self.noise_max - self.noise_min) * squashed
