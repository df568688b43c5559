"""Vision transformers whose parameter names are timm's, so OpenVLA checkpoints load into them.

OpenVLA's fused backbone is two timm ViTs (DINOv2 with registers, SigLIP). timm
does not import beside our CPU torch build, and OpenVLA uses only their
patch-token features, so this module implements that forward pass in plain torch
with timm's parameter names (``patch_embed.proj``, ``blocks.N.attn.qkv``, ...;
LayerScale as ``ls1.scale_factor``, OpenVLA's rename of timm's ``gamma``). Layers
a checkpoint holds but OpenVLA never runs (``norm``, SigLIP's ``attn_pool``) exist
so that a real checkpoint loads strictly; they are not applied.

Shapes: images ``[B, 3, H, W]`` -> patch features ``[B, (H / patch) * (W / patch), dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from envs.common import UserError, unknown_name_error


@dataclass(frozen=True)
class ViTSpec:
    """What a timm ViT id means: Prismatic's DINOv2 / SigLIP ids are in :data:`TIMM_VITS`; tiny ViTs
    are built from dicts."""

    dim: int
    depth: int
    heads: int
    mlp_dim: int
    patch: int = 14
    image_size: int = 224
    class_token: bool = False
    reg_tokens: int = 0
    layer_scale: bool = False
    attn_pool: bool = False  # SigLIP's "map" head: in the checkpoint, never run


SIGLIP_SO400M = ViTSpec(1152, 27, 16, 4304, attn_pool=True)
TIMM_VITS = {  # Prismatic's DINOv2 and SigLIP backbones, alone (dinov2-vit-l, siglip-*) or fused (dinosiglip-*)
    "vit_large_patch14_reg4_dinov2.lvd142m": ViTSpec(1024, 24, 16, 4096, class_token=True, reg_tokens=4,
                                                      layer_scale=True),
    "vit_so400m_patch14_siglip_224": SIGLIP_SO400M,
    "vit_so400m_patch14_siglip_384": replace(SIGLIP_SO400M, image_size=384),
}
MLP_RATIOS = {"vit_large_patch14_reg4_dinov2.lvd142m": 4.0, "vit_so400m_patch14_siglip_224": 3.7362,
              "vit_so400m_patch14_siglip_384": 3.7362}
# Prismatic's other timm ids: named, so that a checkpoint built on one is refused with the reason
UNSUPPORTED_VITS = {
    "vit_large_patch14_clip_224.openai": "a CLIP ViT (pre-norm, quick-GELU, a class token with its own position)",
    "vit_large_patch14_clip_336.openai": "a CLIP ViT (pre-norm, quick-GELU, a class token with its own position)",
    "vit_large_patch16_224.augreg_in21k_ft_in1k": "an ImageNet ViT (a class token with its own position)",
}
DINOV2 = "vit_large_patch14_reg4_dinov2.lvd142m"
# Prismatic's vision_backbone_id values (upstream's configuration_prismatic.py; its OpenVLAConfig refuses any
# other) -> the timm ids they build, fused ones two
PRISMATIC_BACKBONES = {
    "dinov2-vit-l": (DINOV2,),
    "siglip-vit-so400m": ("vit_so400m_patch14_siglip_224",),
    "siglip-vit-so400m-384px": ("vit_so400m_patch14_siglip_384",),
    "dinosiglip-vit-so-224px": (DINOV2, "vit_so400m_patch14_siglip_224"),
    "dinosiglip-vit-so-384px": (DINOV2, "vit_so400m_patch14_siglip_384"),
    "clip-vit-l": ("vit_large_patch14_clip_224.openai",),
    "clip-vit-l-336px": ("vit_large_patch14_clip_336.openai",),
    "in1k-vit-l": ("vit_large_patch16_224.augreg_in21k_ft_in1k",),
    "dinoclip-vit-l-336px": (DINOV2, "vit_large_patch14_clip_336.openai"),
}
# timm keyword arguments a checkpoint may override (``timm_overrides`` in config.json) -> ViTSpec fields
TIMM_KWARGS = {"embed_dim": "dim", "depth": "depth", "num_heads": "heads"}


def timm_spec(timm_id: str, image_size: int, overrides: dict | None = None) -> ViTSpec:
    """The ViT that ``timm.create_model(timm_id, img_size=image_size, **overrides)`` builds (the MLP
    width follows timm: ``int(embed_dim * mlp_ratio)``)."""
    if timm_id in UNSUPPORTED_VITS:
        raise UserError(f"timm_model_ids: {timm_id} is {UNSUPPORTED_VITS[timm_id]}, which this "
                        f"project does not implement (Prismatic's clip-* / dinoclip-* / in1k-* vision backbones). "
                        f"Supported: {', '.join(TIMM_VITS)} (every public OpenVLA and OpenVLA-OFT checkpoint).")
    if timm_id not in TIMM_VITS:
        raise unknown_name_error("timm vision backbone (timm_model_ids)", timm_id, list(TIMM_VITS))
    unknown = {k: v for k, v in (overrides or {}).items() if k not in TIMM_KWARGS}
    if unknown:
        raise UserError(f"timm_overrides for {timm_id} sets {unknown}: only {sorted(TIMM_KWARGS)} "
                        "are understood (the sizes of a ViT built smaller than the timm id's). Remove the other "
                        "keys, or the whole timm_overrides field for a full-size checkpoint.")
    fields = {TIMM_KWARGS[k]: v for k, v in (overrides or {}).items()}
    spec = replace(TIMM_VITS[timm_id], image_size=image_size, **fields)
    check_heads(spec, f"timm_overrides for {timm_id}", names={"heads": "num_heads", "dim": "embed_dim"})
    return replace(spec, mlp_dim=int(spec.dim * MLP_RATIOS[timm_id]))


def check_heads(spec: ViTSpec, where: str, names: dict[str, str] | None = None) -> None:
    """Attention heads must split the width evenly (timm's Attention asserts it when it builds, and the
    ``[B, N, heads, dim / heads]`` view here would fail at the first step); ``names``: the fields' names
    where they are not ViTSpec's (timm's ``num_heads`` / ``embed_dim``)."""
    names = names or {}
    if spec.heads < 1 or spec.dim % spec.heads:
        heads, dim = names.get("heads", "heads"), names.get("dim", "dim")
        raise UserError(f"{where}: {heads}={spec.heads} does not divide {dim}={spec.dim} (timm refuses such a ViT "
                        "when it builds it: each head takes an equal share of the width). Set them as the "
                        "checkpoint's weights were trained, or copy config.json again from the checkpoint.")


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale_factor = nn.Parameter(torch.full((dim,), 1e-5))  # not "gamma": HF renames those keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(spec.dim, eps=1e-6), Attention(spec.dim, spec.heads)
        self.norm2, self.mlp = nn.LayerNorm(spec.dim, eps=1e-6), Mlp(spec.dim, spec.mlp_dim)
        self.ls1 = LayerScale(spec.dim) if spec.layer_scale else nn.Identity()
        self.ls2 = LayerScale(spec.dim) if spec.layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPool(nn.Module):
    """Parameters of timm's attention-pooling head (names only: OpenVLA never runs it)."""

    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.latent = nn.Parameter(torch.zeros(1, 1, spec.dim))
        self.q, self.kv = nn.Linear(spec.dim, spec.dim), nn.Linear(spec.dim, 2 * spec.dim)
        self.proj = nn.Linear(spec.dim, spec.dim)
        self.norm, self.mlp = nn.LayerNorm(spec.dim, eps=1e-6), Mlp(spec.dim, spec.mlp_dim)


class PatchEmbed(nn.Module):
    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.proj = nn.Conv2d(3, spec.dim, spec.patch, spec.patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, patches, dim]


class VisionTransformer(nn.Module):
    """A timm-named ViT; :meth:`forward` returns OpenVLA's features: the patch tokens after the
    second-to-last block (timm's ``get_intermediate_layers(n={depth - 2})``), no final norm."""

    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.spec = spec
        self.num_patches = (spec.image_size // spec.patch) ** 2
        self.patch_embed = PatchEmbed(spec)
        if spec.class_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, spec.dim))
        if spec.reg_tokens:
            self.reg_token = nn.Parameter(torch.zeros(1, spec.reg_tokens, spec.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.num_patches, spec.dim) * 0.02)  # patches only
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.depth))
        self.norm = nn.LayerNorm(spec.dim, eps=1e-6)  # in checkpoints, not applied to OpenVLA's features
        if spec.attn_pool:
            self.attn_pool = AttentionPool(spec)
        self.num_prefix = int(spec.class_token) + spec.reg_tokens

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images [B, 3, H, W]`` (normalised) -> ``[B, num_patches, dim]``."""
        x = self.patch_embed(images) + self.pos_embed  # timm's no_embed_class: position on patches only
        prefix = [t.expand(x.shape[0], -1, -1) for t in (getattr(self, "cls_token", None),
                                                          getattr(self, "reg_token", None)) if t is not None]
        x = torch.cat([*prefix, x], dim=1)
        for block in self.blocks[:len(self.blocks) - 1]:  # through block depth - 2
            x = block(x)
        return x[:, self.num_prefix:]
