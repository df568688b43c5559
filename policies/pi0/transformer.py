"""The two Gemma stacks of pi0 / pi0.5: the VLM reads the prefix (images, language), the action
expert reads the suffix (noisy actions, time, pi0's state) and attends to the VLM's keys and values
layer by layer, as Physical Intelligence's model does.

Both stacks have the same depth, head size and key/value heads (the attention is joint); widths and
MLP sizes differ. Module names mirror the public checkpoints' (``layers.{i}.self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ``norm``), so loading is a near-identity map
(policies/pi0/checkpoint.py). Gemma's parts we reuse from transformers: rotary embeddings
(``apply_rotary_pos_emb``) and grouped-query key expansion (``repeat_kv``).

Shapes: ``x [B, L, W]`` hidden states; keys / values ``[B, kv_heads, L, head_dim]`` after RoPE;
masks are additive ``[B, 1, Lq, Lk]`` (0 where allowed, :data:`MASKED` elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import apply_rotary_pos_emb, repeat_kv

MASKED = -2.3819763e38  # what a disallowed query-key pair adds to the logits (openpi's constant)
ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class StackSize:
    """One Gemma stack: width, layers, MLP width, query heads, key/value heads, head size."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256


class RMSNorm(nn.Module):
    """Gemma's RMSNorm, ``rms(x) * (1 + weight)`` in fp32; with ``cond_dim`` the adaptive form of
    pi0.5's expert (adaRMS): ``dense(cond)`` gives ``scale, shift, gate``, the output is
    ``rms(x) * (1 + scale) + shift`` and ``gate`` scales the residual branch it feeds.
    ``forward(x [B, L, W], cond [B, C] | None)`` -> ``(out [B, L, W], gate [B, 1, W] | None)``."""

    def __init__(self, dim: int, eps: float = 1e-6, cond_dim: int | None = None):
        super().__init__()
        self.eps = eps
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:
            self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if not hasattr(self, "dense"):
            return (normed * (1.0 + self.weight.float())).type_as(x), None
        scale, shift, gate = self.dense(cond)[:, None].chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def gated(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return residual + branch if gate is None else residual + branch * gate


class Attention(nn.Module):
    """Projections only: the attention itself is :func:`attend`, over keys the caller assembles."""

    def __init__(self, width: int, size: StackSize):
        super().__init__()
        self.q_proj = nn.Linear(width, size.num_heads * size.head_dim, bias=False)
        self.k_proj = nn.Linear(width, size.num_kv_heads * size.head_dim, bias=False)
        self.v_proj = nn.Linear(width, size.num_kv_heads * size.head_dim, bias=False)
        self.o_proj = nn.Linear(size.num_heads * size.head_dim, width, bias=False)
        self.head_dim = size.head_dim

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, W]`` -> queries ``[B, heads, L, Hd]``, keys and values ``[B, kv_heads, L, Hd]``, RoPE'd."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eager softmax attention (Gemma's, fp32 softmax): ``q [B, H, Lq, Hd]``, ``k, v [B, Hkv, Lk, Hd]``,
    ``mask [B, 1, Lq, Lk]`` additive -> ``[B, Lq, H * Hd]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    logits = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    weights = nn.functional.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, v).transpose(1, 2).contiguous()
    return out.reshape(*out.shape[:2], -1)


class MLP(nn.Module):
    """Gemma's gated MLP: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, size: StackSize, cond_dim: int | None):
        super().__init__()
        self.self_attn = Attention(size.width, size)
        self.mlp = MLP(size.width, size.mlp_dim)
        self.input_layernorm = RMSNorm(size.width, cond_dim=cond_dim)
        self.post_attention_layernorm = RMSNorm(size.width, cond_dim=cond_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                cond: torch.Tensor | None, past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer over ``x [B, L, W]``; keys and values of ``past`` (another stack's, earlier in the
        sequence) come before ``x``'s own. Returns the output and ``x``'s own keys and values."""
        h, gate = self.input_layernorm(x, cond)
        q, k, v = self.self_attn.qkv(h, *rope)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        x = gated(x, self.self_attn.o_proj(attend(q, keys, values, mask)), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        return gated(x, self.mlp(h), gate), (k, v)


class GemmaStack(nn.Module):
    """``layers`` and a final ``norm`` (adaptive if ``cond_dim``): the VLM's language model or the expert."""

    def __init__(self, size: StackSize, cond_dim: int | None = None):
        super().__init__()
        self.size = size
        self.layers = nn.ModuleList(DecoderLayer(size, cond_dim) for _ in range(size.depth))
        self.norm = RMSNorm(size.width, cond_dim=cond_dim)
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, size.head_dim, 2, dtype=torch.float) / size.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [B, L, Hd]`` of integer ``positions [B, L]``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def cache(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The keys and values of every layer over the prefix ``x [B, P, W]``, and the stack's output
        ``[B, P, W]`` (final norm applied: what a value head reads; the expert needs only the keys and values)."""
        rope, kv = self.rope(positions, x.dtype), []
        for layer in self.layers:
            x, own = layer(x, rope, mask, None)
            kv.append(own)
        return kv, self.norm(x)[0]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past: list[tuple[torch.Tensor, ...]] | None = None, cond: torch.Tensor | None = None) -> torch.Tensor:
        """The stack over ``x [B, S, W]`` attending to ``past`` (per layer, another stack's keys and
        values before ``x``) and to itself as ``mask [B, 1, S, P + S]`` allows; final norm applied."""
        rope = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, rope, mask, cond, None if past is None else past[i])
        return self.norm(x, cond)[0]


def attention_mask_2d(pad: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Which token may attend to which, ``[B, L, L]`` bool (big_vision's prefix-LM rule): ``pad [B, L]``
    marks real tokens, ``blocks [B, L]`` is 1 where a new causal block starts (0: same block as the
    token before). A query sees keys whose block count is at most its own."""
    count = torch.cumsum(blocks, dim=1)
    return (count[:, None, :] <= count[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """``[B, Lq, Lk]`` bool -> ``[B, 1, Lq, Lk]`` float: 0 where allowed, :data:`MASKED` elsewhere."""
    return torch.where(allowed[:, None], 0.0, MASKED)
