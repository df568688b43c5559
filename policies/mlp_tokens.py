"""A token-action policy on flat observations: ``obs["state"]: float32[B, D]`` (and a one-hot
``obs["task"]``).

An MLP trunk scores ``T = chunk_size * A`` action tokens of 256 bins each in one pass, and a
separate MLP critic is its value head. Everything else (the action tokenizer, sampling from seeded
noise, log-probs at the token / action / chunk levels, decoding to env actions, GRPO and SFT) is
the code the VLAs run (``policies/token_actions.py``): only the trunk differs. It answers whether
RL through the VLA action path learns where the simulator is cheap, and tunes VLA RL settings on
a CPU in minutes.

How the trunk's outputs become the ``[B, T, 256]`` bin logits is ``policy.net.token_head``
(:data:`TOKEN_HEADS`): free logits, as a language model's head, or a Gaussian over the bins.
"""

from __future__ import annotations

import torch
from torch import nn

from envs.common import Registry, UserError
from policies.base import POLICIES, mlp, vector_dim, vector_obs
from policies.token_actions import ParallelTokenPolicy
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer

ACTION_BINS = 256  # OpenVLA's: one token per action dimension, 256 uniform bins of [-1, 1]
TOKEN_HEADS = Registry("token head (policy.net.token_head)")
OUT_GAIN = 0.01 * 2**0.5  # small last-layer weights: every token starts near its initial distribution


@TOKEN_HEADS.register("logits")
class FreeLogits(nn.Module):
    """One free logit per bin and token, as a VLA's LM head: ``[B, D] -> [B, T, n_bins]``. Bins
    learn apart (a sample raises its own bin only), so from scratch it starts uniform and learns slowly."""

    def __init__(self, cfg, state_dim: int, tokens: int, locations: torch.Tensor):
        super().__init__()
        self.tokens, self.bins = tokens, locations.numel()
        self.net = mlp([state_dim, *cfg.net.hidden_sizes, tokens * self.bins], cfg.net.activation, out_gain=OUT_GAIN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).unflatten(-1, (self.tokens, self.bins))


@TOKEN_HEADS.register("gaussian")
class GaussianLogits(nn.Module):
    """Bin logits ``-((location_b - mean) / std)^2 / 2``: a Gaussian's log-density at each bin's
    (normalised) action, ``mean [B, T]`` from the MLP and a learned ``std`` per token from
    ``policy.net.log_std_init``. Still a 256-way categorical, sampled and scored as any token, but
    neighbouring bins learn together, as a Gaussian policy's actions do."""

    def __init__(self, cfg, state_dim: int, tokens: int, locations: torch.Tensor):
        super().__init__()
        self.net = mlp([state_dim, *cfg.net.hidden_sizes, tokens], cfg.net.activation, out_gain=OUT_GAIN)
        self.log_std = nn.Parameter(torch.full((tokens,), float(cfg.net.log_std_init)))
        self.register_buffer("locations", locations.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.net(x).unsqueeze(-1)  # [B, T, 1]
        return -0.5 * ((self.locations - mean) / self.log_std.exp().unsqueeze(-1)) ** 2


@POLICIES.register("mlp_tokens")
class MLPTokenPolicy(ParallelTokenPolicy):
    """Separate actor and critic MLPs (as ``policy=mlp``); the actor's head gives the logits
    ``[B, T, 256]`` (``policy.net.token_head``)."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        state_dim = vector_dim(obs_spec)
        if not state_dim:
            raise UserError(f"policy=mlp_tokens needs flat state observations; this env gives {sorted(obs_spec)}. Use "
                            "an env with obs_mode: state (e.g. env=maniskill_pushcube), or a VLA policy for images.")
        actions = ActionTokenizer(ActionStats.identity(action_dim), n_bins=ACTION_BINS, mode="added", first_id=0)
        self._setup_actions(cfg, action_dim, actions)
        self.actor = TOKEN_HEADS.get(cfg.net.token_head)(cfg, state_dim, self.noise_dim, actions.bin_values())
        self.value_head = mlp([state_dim, *cfg.net.hidden_sizes, 1], cfg.net.activation, out_gain=1.0)

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        TOKEN_HEADS.get(cfg.net.token_head)
        return []

    def token_logits(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = vector_obs(obs)
        return self.actor(x), self.value_head(x).squeeze(-1)
