"""pi0 and pi0.5 (Physical Intelligence): a PaliGemma VLM reads the prefix, a Gemma action expert
denoises a chunk of actions by flow matching, attending to the VLM's keys and values.

- prefix: each camera through SigLIP and the projector (``[B, 256, W]`` per 224 px image), then the
  prompt's token embeddings (scaled by ``sqrt(W)``); every prefix token sees every other real one;
- suffix, pi0: the state token (``state_proj``) and ``H`` action tokens mixing ``action_in_proj(x_t)``
  with the time's sinusoidal embedding through ``action_time_mlp_*``; the state token sees the prefix
  and itself, the action tokens the prefix, the state and each other;
- suffix, pi0.5: ``H`` action tokens (``action_in_proj(x_t)``); the time conditions every norm of the
  expert (adaRMS) through ``time_mlp_*``; the state is in the prompt (policies/pi0/prompt.py);
- the velocity ``v [B, H, 32] = action_out_proj(expert(suffix))``, integrated from ``t = 1`` (the
  noise) to ``t = 0`` by ``K`` Euler steps ``x <- x - v / K`` (policies/flow_steps.py's convention).

Actions and states are padded to ``max_action_dim`` / ``max_state_dim`` (32). Module names mirror
the public checkpoints' (lerobot's ``PI0Pytorch`` without its ``model.`` prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from policies.flow_steps import ode_mean, time_grid
from policies.pi0.transformer import GemmaStack, StackSize, additive, attention_mask_2d

# what lerobot keeps in float32 when it runs the Gemma stacks in bfloat16 (to_bfloat16_for_selected_params):
# the vision tower, the projector and every norm (the adaRMS dense layers too)
FLOAT32_ISLANDS = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm", "model.norm")


@dataclass(frozen=True)
class VisionSize:
    """SigLIP: so400m/14 at 224 px by default (the public checkpoints')."""

    hidden: int = 1152
    depth: int = 27
    heads: int = 16
    mlp_dim: int = 4304
    patch: int = 14
    image_size: int = 224

    def config(self) -> SiglipVisionConfig:
        return SiglipVisionConfig(hidden_size=self.hidden, num_hidden_layers=self.depth,
                                  num_attention_heads=self.heads, intermediate_size=self.mlp_dim,
                                  patch_size=self.patch, image_size=self.image_size, vision_use_head=False,
                                  hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


GEMMA_2B = StackSize(width=2048, depth=18, mlp_dim=16_384)
GEMMA_300M = StackSize(width=1024, depth=18, mlp_dim=4096)


@dataclass(frozen=True)
class PiSize:
    """Everything that shapes the network; the public checkpoints' sizes by default."""

    pi05: bool = False
    vlm: StackSize = GEMMA_2B
    expert: StackSize = GEMMA_300M
    vision: VisionSize = field(default_factory=VisionSize)
    vocab_size: int = 257_152
    max_action_dim: int = 32
    max_state_dim: int = 32
    chunk_size: int = 50
    min_period: float = 4e-3  # the time embedding's sinusoid periods (lerobot's config.json min_period / max_period)
    max_period: float = 4.0


class LanguageModel(GemmaStack):
    """The VLM's Gemma: the stack and its token embedding (scaled by ``sqrt(width)``)."""

    def __init__(self, size: StackSize, vocab_size: int):
        super().__init__(size)
        self.embed_tokens = nn.Embedding(vocab_size, size.width, padding_idx=0)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.size.width**0.5).to(self.embed_tokens.weight.dtype)  # fp32, then the weights'

        return self.embed_tokens(tokens) * scale


class Projector(nn.Module):
    def __init__(self, vision: int, width: int):
        super().__init__()
        self.linear = nn.Linear(vision, width)


class PaliGemma(nn.Module):
    """``model.{vision_tower, multi_modal_projector, language_model}`` as the checkpoints name them."""

    def __init__(self, size: PiSize):
        super().__init__()
        self.model = nn.Module()
        self.model.vision_tower = SiglipVisionModel(size.vision.config())
        self.model.multi_modal_projector = Projector(size.vision.hidden, size.vlm.width)
        self.model.language_model = LanguageModel(size.vlm, size.vocab_size)


class Expert(nn.Module):
    def __init__(self, size: PiSize):
        super().__init__()
        self.model = GemmaStack(size.expert, cond_dim=size.expert.width if size.pi05 else None)


class PaliGemmaWithExpert(nn.Module):
    def __init__(self, size: PiSize):
        super().__init__()
        if (size.vlm.depth, size.vlm.head_dim, size.vlm.num_heads, size.vlm.num_kv_heads) != (
                size.expert.depth, size.expert.head_dim, size.expert.num_heads, size.expert.num_kv_heads):
            raise ValueError("pi0's VLM and expert attend jointly: they need the same depth and heads")
        self.paligemma = PaliGemma(size)
        self.gemma_expert = Expert(size)


@dataclass
class Prefix:
    """What the expert attends to: every VLM layer's keys and values ``[B, kv_heads, P, Hd]`` and
    which of the ``P`` prefix tokens are real (``pad [B, P]``); and the VLM's output ``hidden [B, P, W]``."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pad: torch.Tensor
    hidden: torch.Tensor

    def repeat_interleave(self, repeats: int, dim: int = 0) -> Prefix:
        """Each sample ``repeats`` times in a row (a batch of several chain steps per sample)."""
        kv = [(k.repeat_interleave(repeats, dim), v.repeat_interleave(repeats, dim)) for k, v in self.kv]
        return Prefix(kv, self.pad.repeat_interleave(repeats, dim), self.hidden.repeat_interleave(repeats, dim))

    def pooled(self) -> torch.Tensor:
        """``[B, W]`` float32: the mean of the real tokens' output."""
        weights = self.pad[..., None].float()
        return (self.hidden.float() * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sinusoids of ``t [B]`` -> ``[B, dim]`` (sin then cos), periods from ``min_period`` to ``max_period``, in
    float64."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)


class PiZero(nn.Module):
    """The network of pi0 (``size.pi05`` false) or pi0.5. Inputs: ``images``, a list (one per camera)
    of ``[B, 3, S, S]`` in [-1, 1] at the vision size; ``image_masks``, a list of ``[B]`` bool;
    ``tokens [B, L]`` and ``token_masks [B, L]`` bool (the prompt, right-padded); ``state [B, 32]``
    (pi0; normalised, padded); actions and noise ``[B, H, 32]``; ``t [B]``."""

    def __init__(self, size: PiSize):
        super().__init__()
        self.size = size
        e = size.expert.width
        self.paligemma_with_expert = PaliGemmaWithExpert(size)
        self.action_in_proj = nn.Linear(size.max_action_dim, e)
        self.action_out_proj = nn.Linear(e, size.max_action_dim)
        if size.pi05:
            self.time_mlp_in, self.time_mlp_out = nn.Linear(e, e), nn.Linear(e, e)
        else:
            self.state_proj = nn.Linear(size.max_state_dim, e)
            self.action_time_mlp_in, self.action_time_mlp_out = nn.Linear(2 * e, e), nn.Linear(e, e)

    def use_bfloat16(self) -> None:
        """lerobot's mixed precision (``dtype: bfloat16``): the two Gemma stacks' weights, token embedding and
        rotary frequencies in bfloat16, :data:`FLOAT32_ISLANDS` and the heads outside the stacks in float32.
        Activations follow: SigLIP, the projector, the time MLPs, the action projections and the Euler
        steps run in float32; the stacks in bfloat16 (norms and softmax computed in float32)."""
        stacks = self.paligemma_with_expert
        for name, param in stacks.named_parameters():  # lerobot casts before it loads: the islands keep every bit
            if not any(island in name for island in FLOAT32_ISLANDS):
                param.data = param.data.to(torch.bfloat16)
        for module in stacks.modules():  # the rotary frequencies too, as lerobot's .to(bfloat16) casts them
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(torch.bfloat16))

    @property
    def stack_dtype(self) -> torch.dtype:
        return self.expert.layers[0].self_attn.q_proj.weight.dtype

    @property
    def vlm(self) -> PaliGemma:
        return self.paligemma_with_expert.paligemma

    @property
    def expert(self) -> GemmaStack:
        return self.paligemma_with_expert.gemma_expert.model

    # -- the prefix ----------------------------------------------------------------------------------
    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` -> ``[B, patches, W]``: SigLIP's last hidden state, projected (in fp32)."""
        model = self.vlm.model
        features = model.vision_tower(pixel_values=image.float()).last_hidden_state
        return model.multi_modal_projector.linear(features).to(image.dtype)

    def embed_prefix(self, images: list[torch.Tensor], image_masks: list[torch.Tensor], tokens: torch.Tensor,
                     token_masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings [B, P, W], pad [B, P])``: the cameras' patches, then the prompt's tokens."""
        embs, pad = [], []
        for image, mask in zip(images, image_masks, strict=True):
            emb = self.embed_image(image)
            embs.append(emb)
            pad.append(mask[:, None].expand(emb.shape[:2]))
        embs.append(self.vlm.model.language_model.embed(tokens))
        pad.append(token_masks)
        return torch.cat(embs, 1), torch.cat(pad, 1)

    def prefix(self, images: list[torch.Tensor], image_masks: list[torch.Tensor], tokens: torch.Tensor,
               token_masks: torch.Tensor) -> Prefix:
        """The VLM's keys and values over the prefix (one bidirectional block; padding skipped)."""
        embs, pad = self.embed_prefix(images, image_masks, tokens, token_masks)
        mask = additive(attention_mask_2d(pad, torch.zeros_like(pad, dtype=torch.long)))
        positions = torch.cumsum(pad, dim=1) - 1  # padding repeats the last position
        kv, hidden = self.vlm.model.language_model.cache(embs.to(self.stack_dtype), positions, mask)
        return Prefix(kv, pad, hidden)

    # -- the suffix ----------------------------------------------------------------------------------
    def embed_suffix(self, state: torch.Tensor | None, x_t: torch.Tensor, t: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(embeddings [B, S, E], blocks [S], adaRMS condition [B, E] | None)``; ``S = H`` (+1: pi0's state)."""
        time = time_embedding(t, self.size.expert.width, self.size.min_period, self.size.max_period)
        actions = self.action_in_proj(x_t)
        chunk = x_t.shape[1]
        if self.size.pi05:
            cond = nn.functional.silu(self.time_mlp_out(nn.functional.silu(self.time_mlp_in(time))))
            return actions, torch.tensor([1] + [0] * (chunk - 1)), cond
        mixed = torch.cat([actions, time[:, None, :].expand_as(actions)], dim=2)
        mixed = self.action_time_mlp_out(nn.functional.silu(self.action_time_mlp_in(mixed)))
        state_token = self.state_proj(state.float())[:, None, :]
        return torch.cat([state_token, mixed], 1), torch.tensor([1, 1] + [0] * (chunk - 1)), None

    def velocity(self, prefix: Prefix, state: torch.Tensor | None, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``v [B, H, 32]`` at ``x_t [B, H, 32]``, time ``t [B]``, given the prefix's keys and values."""
        return self.action_out_proj(self.expert_output(prefix, state, x_t, t).float())

    def expert_output(self, prefix: Prefix, state: torch.Tensor | None, x_t: torch.Tensor, t: torch.Tensor
                      ) -> torch.Tensor:
        """The expert's output over the ``H`` action tokens ``[B, H, E]`` (final norm applied)."""
        suffix, blocks, cond = self.embed_suffix(state, x_t, t)
        b, s, p = suffix.shape[0], suffix.shape[1], prefix.pad.shape[1]
        own = attention_mask_2d(torch.ones(b, s, dtype=torch.bool, device=suffix.device),
                                blocks.to(suffix.device)[None].expand(b, s))
        mask = additive(torch.cat([prefix.pad[:, None, :].expand(b, s, p), own], dim=2))
        positions = prefix.pad.sum(-1)[:, None] + torch.arange(s, device=suffix.device)[None]
        out = self.expert(suffix.to(self.stack_dtype), positions, mask, prefix.kv, cond)
        return out[:, -x_t.shape[1]:]

    # -- sampling and the flow-matching loss ------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prefix: Prefix, state: torch.Tensor | None, noise: torch.Tensor, steps: int = 10,
               times: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk ``[B, H, 32]``: ``steps`` Euler steps of the ODE from ``noise`` (at ``t = 1``), at ``times``
        (``[steps + 1]``; default :func:`~policies.flow_steps.time_grid`)."""
        x, grid = noise, (time_grid(steps) if times is None else times).to(noise.device)
        for k in range(steps):
            x = ode_mean(x, self.velocity(prefix, state, x, grid[k].expand(len(x))), 1.0 / steps)
        return x

    def flow_loss(self, prefix: Prefix, state: torch.Tensor | None, actions: torch.Tensor, noise: torch.Tensor,
                  t: torch.Tensor) -> torch.Tensor:
        """Per-element squared error ``[B, H, 32]`` of the velocity against ``noise - actions`` at
        ``x_t = t * noise + (1 - t) * actions``."""
        tt = t[:, None, None]
        v = self.velocity(prefix, state, tt * noise + (1 - tt) * actions, t)
        return (noise - actions - v) ** 2
