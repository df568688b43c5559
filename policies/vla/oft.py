"""OpenVLA-OFT: OpenVLA with parallel decoding of an action chunk in one forward pass.

After the prompt come ``T = chunk_size * A`` placeholder tokens whose input embeddings are
zero (OFT's "empty action embeddings") and, with ``policy.stop_token`` (OFT's own layout and
SimpleVLA-RL's; RLinf drops it), the real STOP token ``</s>``. Attention is **bidirectional**
(every token sees every non-padding token), as OFT's transformers fork makes Llama's SDPA
attention. The hidden states from the last prompt token through placeholder ``T - 2`` (OFT's
``NUM_PATCHES + NUM_PROMPT_TOKENS`` slice) predict the ``T`` action tokens:

- **token OFT** (the layout RLinf and SimpleVLA-RL train with RL): their LM-head logits over the
  256 action bins, so sampling all ``T`` tokens and the teacher-forced log-probs PPO needs come
  from one pass;
- **L1 OFT** (moojink/openvla-oft's public LIBERO checkpoints, which ship an
  ``action_head--*_checkpoint.pt``): OFT's MLP-ResNet head regresses the normalised chunk from
  them. It has no probabilities, so it acts for ``eval`` and ``record`` but cannot be trained with RL.

With ``policy.proprio`` the env's ``state`` becomes one more token after the image patches, through
OFT's ``proprio_projector`` (fc1, GELU, fc2), normalised with the checkpoint's proprio q01 / q99
when its ``dataset_statistics.json`` has them (as OFT's ``normalize_proprio``).

Sequence: ``[BOS] + patches (per camera) (+ proprio) + prompt[1:] + T placeholders (+ STOP)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from envs.common import UserError
from policies.base import POLICIES
from policies.token_actions import ParallelTokenPolicy
from policies.vla.policy import OpenVLAPolicy, dataset_statistics

STOP_TOKEN_ID = 2  # Llama's </s>: OFT's STOP_INDEX
LEGACY_PROPRIO_FILE = "proprio_projector.pt"  # what this project saved before


class ProprioProjector(nn.Module):
    """OFT's proprioception projector: ``[B, D] -> [B, H]`` (state-dict names fc1 / fc2)."""

    def __init__(self, state_dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act_fn1, self.fc2 = nn.Linear(state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn1(self.fc1(state)))


class ResidualBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """LayerNorm, fc1, ReLU, residual blocks, LayerNorm, fc2 (OFT's ``MLPResNet`` state-dict names)."""

    def __init__(self, blocks: int, input_dim: int, hidden: int, output_dim: int):
        super().__init__()
        self.layer_norm1, self.fc1, self.relu = nn.LayerNorm(input_dim), nn.Linear(input_dim, hidden), nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(blocks))
        self.layer_norm2, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """OFT's continuous head: hidden states ``[B, chunk * A, H]`` -> normalised actions ``[B, chunk, A]``."""

    def __init__(self, hidden: int, action_dim: int):
        super().__init__()
        self.model = MLPResNet(2, hidden * action_dim, hidden, action_dim)

    def forward(self, hidden_states: torch.Tensor, chunk: int) -> torch.Tensor:
        return self.model(hidden_states.reshape(hidden_states.shape[0], chunk, -1))


def component_file(model_dir: str | Path, name: str) -> Path | None:
    """OFT's ``find_checkpoint_file``: the one ``{name}--*checkpoint.pt`` in ``model_dir`` (None if none)."""
    matches = sorted(p for p in Path(model_dir).glob(f"{name}*checkpoint.pt"))
    if len(matches) > 1:
        raise UserError(f"{model_dir} holds {len(matches)} {name} files ({[p.name for p in matches]}); OFT's loader "
                        "takes exactly one. Keep the one from the training step you evaluate.")
    return matches[0] if matches else None


def load_component(module: nn.Module, path: Path) -> None:
    """A component saved by OFT's DDP training (``module.`` prefixed keys) or by this project."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise UserError(f"{path} does not fit this model ({str(err).splitlines()[0]}): it belongs to a checkpoint "
                        "of another size. Copy the component files of the same checkpoint as config.json.") from err


def proprio_stats(model_dir: str | None, norm_stats: dict | None, unnorm_key: str | None) -> torch.Tensor | None:
    """``[2, D]`` q01 / q99 of the checkpoint's proprio statistics (:func:`dataset_statistics`, as
    OFT's ``vla.norm_stats``), or None: the state is fed as it is."""
    found = dataset_statistics(model_dir, norm_stats, unnorm_key) if model_dir else None
    proprio = found[1].get("proprio") if found else None
    return None if proprio is None else torch.tensor([proprio["q01"], proprio["q99"]], dtype=torch.float64)


def bidirectional_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` padding mask -> additive ``[B, 1, L, L]``: every query sees every non-padding key
    (OFT's fork: the causal mask's last row for every row)."""
    blocked = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, torch.finfo(dtype).min)
    return blocked[:, None, None, :].expand(-1, 1, mask.shape[1], -1)


@POLICIES.register("openvla_oft")
class OpenVLAOFTPolicy(ParallelTokenPolicy, OpenVLAPolicy):
    """OpenVLA backbone (same checkpoint layout), parallel decoding of ``policy.chunk_size`` actions:
    sampling, log-probs and the value come from :class:`ParallelTokenPolicy` over :meth:`token_logits`."""

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(cfg, obs_spec, action_dim)
        self.stop_token = cfg.stop_token
        dtype = next(self.model.parameters()).dtype
        hidden = self.model.config.text_config.hidden_size
        head = component_file(cfg.model_path, "action_head") if cfg.model_path else None
        self.action_head = None
        if head is not None:
            self.action_head = L1RegressionActionHead(hidden, action_dim).to(dtype)
            load_component(self.action_head, head)
        self.proprio_projector, self.proprio_q = None, None
        if cfg.proprio:
            if "state" not in obs_spec:
                raise UserError("policy.proprio=true needs a `state` observation; this env has none "
                                f"(it has {sorted(obs_spec)}). Set policy.proprio=false.")
            self.proprio_projector = ProprioProjector(obs_spec["state"][0][0], hidden).to(dtype)
            saved = self._proprio_file(cfg.model_path)
            if saved is not None:
                load_component(self.proprio_projector, saved)
            self.proprio_q = proprio_stats(cfg.model_path, self.model.config.norm_stats, cfg.unnorm_key)

    @staticmethod
    def untrainable_reason(cfg) -> str | None:
        """Why ``embodied train`` cannot train this checkpoint (an L1 head has no action probabilities)."""
        head = component_file(cfg.model_path, "action_head") if cfg.model_path else None
        if head is None:
            return None
        return (f"policy.model_path={cfg.model_path} is an L1-regression OpenVLA-OFT checkpoint (it has {head.name}): "
                "its continuous action head gives no action probabilities, so PPO / GRPO cannot train it; it acts "
                "for `embodied eval` and `embodied record`. RL starts from a token OFT checkpoint: the same "
                "directory layout without action_head--*.pt, trained to predict the 256 action tokens with the "
                "LM head (SimpleVLA-RL's Haozhan72/Openvla-oft-SFT-* or RLinf's RLinf/RLinf-OpenVLAOFT-*; "
                "docs/vla_checkpoints.md).")

    @staticmethod
    def _proprio_file(model_dir: str | None) -> Path | None:
        if not model_dir:
            return None
        legacy = Path(model_dir) / LEGACY_PROPRIO_FILE
        return component_file(model_dir, "proprio_projector") or (legacy if legacy.exists() else None)

    def _proprio(self, state: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` -> the projector's input: OFT's ``normalize_proprio`` with the checkpoint's statistics."""
        if self.proprio_q is None:
            return state
        low, high = self.proprio_q[0].to(state.device), self.proprio_q[1].to(state.device)
        return (2 * (state.double() - low) / (high - low + 1e-8) - 1).clamp(-1.0, 1.0)

    def _forward(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass -> ``(logits [B, T, V], hidden [B, T, H], value [B])`` at the positions that
        predict the ``T`` action tokens (the last prompt token through placeholder ``T - 2``)."""
        ids, mask = self._prompt_ids(obs)
        device = ids.device
        batch, tokens = ids.shape[0], self.noise_dim
        embeds, mask = self.model.multimodal_embeddings(ids, self._pixel_values(obs, device), mask)
        if self.proprio_projector is not None:
            after_patches = 1 + self.model.num_patches * len(self.cameras)
            state = self._proprio(obs["state"].to(device)).to(embeds.dtype)
            token = self.proprio_projector(state).unsqueeze(1)
            embeds = torch.cat([embeds[:, :after_patches], token, embeds[:, after_patches:]], dim=1)
            mask = torch.cat([mask[:, :after_patches], mask.new_ones(batch, 1), mask[:, after_patches:]], dim=1)
        tail = [embeds.new_zeros(batch, tokens, embeds.shape[-1])]
        if self.stop_token:
            stop = torch.full((batch, 1), STOP_TOKEN_ID, dtype=torch.long, device=device)
            tail.append(self.model.get_input_embeddings()(stop))
        embeds = torch.cat([embeds, *tail], dim=1)
        mask = torch.cat([mask, mask.new_ones(batch, embeds.shape[1] - mask.shape[1])], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding skipped: positions as if unpadded
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=bidirectional_mask(mask, embeds.dtype),
                                        position_ids=positions, output_hidden_states=True)
        end = embeds.shape[1] - int(self.stop_token) - 1  # one past placeholder T - 2
        hidden = out.hidden_states[-1][:, end - tokens:end]
        value = self.value_head(hidden[:, 0]).squeeze(-1)  # the last prompt token
        return out.logits[:, end - tokens:end], hidden, value

    def token_logits(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _, value = self._forward(obs)
        return logits, value

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        """Token OFT: sampled (or greedy) bins ``[B, T]``. L1 OFT: the regressed normalised chunk
        ``[B, T]`` (deterministic either way; its log-probs are zeros)."""
        if self.action_head is None:
            return super().act(obs, deterministic, noise)
        _, hidden, value = self._forward(obs)
        chunk = self.action_head(hidden, self.chunk_size).flatten(1).float()
        return chunk, torch.zeros_like(chunk), value

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        if self.action_head is None:
            return super().to_env(actions)
        chunk = self.actions.unnormalize(actions.unflatten(-1, (self.chunk_size, self.action_dim)).cpu())
        chunk = self.adapter.actions(chunk.to(actions.device))
        return chunk if self.chunk_size > 1 else chunk[:, 0]

    def save_pretrained(self, path: str | Path) -> None:
        """A model directory ``policy.model_path`` loads: the backbone, tokenizer and OFT's component files."""
        super().save_pretrained(path)
        for name, module in (("proprio_projector", self.proprio_projector), ("action_head", self.action_head)):
            if module is not None:
                torch.save({f"module.{k}": v for k, v in module.state_dict().items()},  # OFT's name pattern
                           Path(path) / f"{name}--0_checkpoint.pt")
