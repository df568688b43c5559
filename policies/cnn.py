"""CNN actor-critic for pixels: ``obs["rgb"]: uint8[B, H, W, C]`` (+ optional ``obs["state"]`` and
one-hot ``obs["task"]``; other keys, such as LIBERO's wrist camera, are not used)."""

from __future__ import annotations

import torch
from torch import nn

from envs.common import UserError
from policies.base import (
    POLICIES,
    Conv2d,
    GaussianActorCritic,
    Linear,
    layer_init,
    mlp,
    vector_dim,
    vector_obs,
)


class ConvEncoder(nn.Module):
    """Nature-CNN: three strided convolutions, then a linear layer to ``feature_dim``."""

    def __init__(self, in_channels: int, image_hw: tuple[int, int], channels: list[int], feature_dim: int):
        super().__init__()
        kernels, strides = [8, 4, 3], [4, 2, 1]
        layers: list[nn.Module] = []
        prev = in_channels
        for ch, k, s in zip(channels, kernels, strides, strict=False):
            layers += [layer_init(Conv2d(prev, ch, k, s)), nn.ReLU()]
            prev = ch
        self.convs = nn.Sequential(*layers, nn.Flatten())
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, in_channels, *image_hw)).shape[-1]
        self.fc = nn.Sequential(layer_init(Linear(flat, feature_dim)), nn.ReLU())

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        """``rgb``: uint8 ``[B, H, W, C]`` -> float ``[B, feature_dim]``."""
        x = rgb.permute(0, 3, 1, 2).float() / 255.0
        return self.fc(self.convs(x))


@POLICIES.register("cnn")
class CNNActorCritic(GaussianActorCritic):
    """Image (+ state) encoder shared by actor and critic heads."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(action_dim, cfg.net.log_std_init)
        if "rgb" not in obs_spec:
            raise UserError("policy=cnn needs image observations: use an env with obs_mode: rgb "
                            "(e.g. env=maniskill_pushcube_rgb), or policy=mlp for state observations.")
        h, w, c = obs_spec["rgb"][0]
        self.encoder = ConvEncoder(c, (h, w), list(cfg.net.cnn_channels), cfg.net.feature_dim)
        feat = cfg.net.feature_dim
        self.state_dim = vector_dim(obs_spec)
        if self.state_dim:
            self.state_encoder = mlp([self.state_dim, feat], cfg.net.activation)
            feat += feat
        hidden = list(cfg.net.hidden_sizes)
        self.actor = mlp([feat, *hidden, action_dim], cfg.net.activation, out_gain=0.01 * 2**0.5)
        self.critic = mlp([feat, *hidden, 1], cfg.net.activation, out_gain=1.0)

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        feats = self.encoder(obs["rgb"])
        if self.state_dim:
            feats = torch.cat([feats, torch.relu(self.state_encoder(vector_obs(obs)))], dim=-1)
        return feats

    def actor_mean(self, obs):
        return self.actor(self.features(obs))

    def value(self, obs):
        return self.critic(self.features(obs)).squeeze(-1)

    def heads(self, obs):
        feats = self.features(obs)  # one encoder pass for both heads
        return self.actor(feats), self.critic(feats).squeeze(-1)

    def evaluate(self, obs, actions):
        # one encoder pass for both heads
        feats = self.features(obs)
        mean = self.actor(feats)
        dist = torch.distributions.Normal(mean, self.log_std.expand_as(mean).exp())
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.critic(feats).squeeze(-1)
