"""A token-action policy on flat observations: ``obs["state"]: float32[B, D]`` (and a one-hot
``obs["task"]``).

An MLP trunk scores ``T = chunk_size * A`` action tokens of 256 bins each in one pass, and a
separate MLP critic is its value head. Everything else (the action tokenizer, sampling from seeded
noise, log-probs at the token / action / chunk levels, decoding to env actions, GRPO and SFT) is
the code the VLAs run (``policies/token_actions.py``): only the trunk differs. It answers whether
RL through the VLA action path learns where the simulator is cheap, and tunes VLA RL settings on
a CPU in minutes.
"""

from __future__ import annotations

import torch

from envs.common import UserError
from policies.base import POLICIES, mlp, vector_dim, vector_obs
from policies.token_actions import ParallelTokenPolicy
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer

ACTION_BINS = 256  # OpenVLA's: one token per action dimension, 256 uniform bins of [-1, 1]


@POLICIES.register("mlp_tokens")
class MLPTokenPolicy(ParallelTokenPolicy):
    """Separate actor and critic MLPs (as ``policy=mlp``); the actor's last layer gives the logits
    ``[B, T, 256]``. Its small output gain starts every token near uniform over the bins."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        if not vector_dim(obs_spec):
            raise UserError(f"policy=mlp_tokens needs flat state observations; this env gives {sorted(obs_spec)}. Use "
                            "an env with obs_mode: state (e.g. env=maniskill_pushcube), or a VLA policy for images.")
        actions = ActionTokenizer(ActionStats.identity(action_dim), n_bins=ACTION_BINS, mode="added", first_id=0)
        self._setup_actions(cfg, action_dim, actions)
        state_dim, hidden = vector_dim(obs_spec), list(cfg.hidden_sizes)
        self.actor = mlp([state_dim, *hidden, self.noise_dim * ACTION_BINS], cfg.activation, out_gain=0.01 * 2**0.5)
        self.value_head = mlp([state_dim, *hidden, 1], cfg.activation, out_gain=1.0)

    def token_logits(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = vector_obs(obs)
        return self.actor(x).unflatten(-1, (self.noise_dim, ACTION_BINS)), self.value_head(x).squeeze(-1)
