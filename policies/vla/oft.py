"""OpenVLA-OFT: OpenVLA with parallel decoding of an action chunk in one forward pass.

After the prompt come ``T = chunk_size * A`` placeholder tokens whose input embeddings are
zero (OFT's "empty action embeddings"); the language model's output at placeholder ``j``
is the distribution of action token ``j`` over the 256 bins (OpenVLA's last vocabulary ids).
No token is fed back, so sampling all ``T`` tokens costs one forward pass instead of ``T``,
and the teacher-forced log-probs PPO needs come from the same pass. The placeholders attend
causally (transformers' Llama mask; OFT makes them bidirectional): they carry no content, so
each action token is predicted from the prompt and its position.

With ``policy.proprio`` the env's ``state`` (proprioception) becomes one more input token
after the image patches, through OFT's two-layer ``proprio_projector`` (fc1, GELU, fc2).

Sequence: ``[BOS] + image patches (+ proprio) + prompt[1:] + T placeholders``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from policies.registry import POLICIES
from policies.vla.policy import OpenVLAPolicy

PROPRIO_FILE = "proprio_projector.pt"  # next to a model directory's config.json, with policy.proprio


class ProprioProjector(nn.Module):
    """OFT's proprioception projector: ``[B, D] -> [B, H]`` (state-dict names fc1 / fc2)."""

    def __init__(self, state_dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act_fn, self.fc2 = nn.Linear(state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(state)))


@POLICIES.register("openvla_oft")
class OpenVLAOFTPolicy(OpenVLAPolicy):
    """OpenVLA backbone (same checkpoint layout), parallel decoding of ``policy.chunk_size`` actions."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(cfg, obs_spec, action_dim)
        self.proprio_projector = None
        if cfg.proprio:
            if "state" not in obs_spec:
                from embodied.errors import UserError

                raise UserError("policy.proprio=true needs a `state` observation; this env has none "
                                f"(it has {sorted(obs_spec)}). Set policy.proprio=false.")
            hidden = self.model.config.text_config.hidden_size
            self.proprio_projector = ProprioProjector(obs_spec["state"][0][0], hidden)
            saved = Path(cfg.model_path or "") / PROPRIO_FILE
            if cfg.model_path and saved.exists():
                self.proprio_projector.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))

    def _parallel(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass -> ``(bin log-probs [B, T, n_bins], value [B])``."""
        ids, mask = self._prompt_ids(obs)
        device = ids.device
        batch, tokens = ids.shape[0], self.noise_dim
        embeds, mask = self.model.multimodal_embeddings(ids, self.images(obs["rgb"]).to(device), mask)
        if self.proprio_projector is not None:
            after_patches = 1 + self.model.num_patches
            state = self.proprio_projector(obs["state"].to(device).float()).unsqueeze(1)
            embeds = torch.cat([embeds[:, :after_patches], state, embeds[:, after_patches:]], dim=1)
            mask = torch.cat([mask[:, :after_patches], mask.new_ones(batch, 1), mask[:, after_patches:]], dim=1)
        embeds = torch.cat([embeds, embeds.new_zeros(batch, tokens, embeds.shape[-1])], dim=1)
        mask = torch.cat([mask, mask.new_ones(batch, tokens)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: every row counts from its BOS
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                        output_hidden_states=True)
        value = self.value_head(out.hidden_states[-1][:, -tokens - 1]).squeeze(-1)  # the last prompt token
        return self._bin_logprobs(out.logits[:, -tokens:]), value

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        logp, value = self._parallel(obs)
        bins = self._sample(logp, self._uniform(logp.shape[0], deterministic, noise, logp.device))
        return bins.float(), logp.gather(-1, bins.unsqueeze(-1)).squeeze(-1), value

    def bin_distributions(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Log-probs of every bin at every action token ``[B, T, n_bins]`` (they do not depend on
        ``actions``: nothing is fed back), and the value."""
        return self._parallel(obs)

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._parallel(obs)[1]

    def save_pretrained(self, path: str | Path) -> None:
        """A model directory ``policy.model_path`` loads: the backbone, tokenizer and proprio projector."""
        super().save_pretrained(path)
        if self.proprio_projector is not None:
            torch.save(self.proprio_projector.state_dict(), Path(path) / PROPRIO_FILE)
