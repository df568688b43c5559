"""OpenVLA (Prismatic): fused DINOv2 + SigLIP patch features (or, with ``use_fused_vision_backbone:
false``, one ViT's) -> MLP projector -> Llama, built from transformers' Llama and our timm-named
ViTs (:mod:`policies.vla.vit`).

Module and state-dict names are those of the public ``openvla/openvla-7b`` checkpoint
(``vision_backbone.featurizer.*``, ``vision_backbone.fused_featurizer.*``,
``projector.fc{1,2,3}`` (single backbone: ``fc{1,2}``), ``language_model.*``; see
docs/vla_checkpoints.md), and
the config reads its ``config.json``, so ``OpenVLAForActionPrediction.from_pretrained``
loads a real checkpoint directory as well as the tiny models the tests save.

Sequence layout: ``[BOS] + projected patches + the rest of the prompt``. Shapes:
``pixel_values [B, 6, H, W]`` (DINOv2-normalised image, then SigLIP-normalised
image, stacked on channels; ``[B, 3, H, W]`` with one backbone), ``input_ids [B, L]`` ->
``logits [B, 1 + P + L - 1, V]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel

from envs.common import UserError, unknown_name_error
from policies.vla.checkpoint import read_pretrained_config
from policies.vla.vit import PRISMATIC_BACKBONES, VisionTransformer, ViTSpec, check_heads, timm_spec

PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
# Prismatic's llm_backbone_id values whose model is a Llama (configuration_prismatic.py); its
# mistral-* and phi-* backbones have other architectures and tokenizers
DINOSIGLIP = ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224")  # openvla-7b's backbones
# RoPE variants whose arithmetic in this transformers equals upstream's 4.40.1 (proven by a fixture:
# linear). 4.40.1's "dynamic" rescales statefully between calls, which a newer transformers does not.
ROPE_TYPES = ("default", "linear")
LLAMA_BACKBONES = ("llama2-7b-pure", "llama2-13b-pure", "llama2-7b-chat", "llama2-13b-chat", "vicuna-v15-7b",
                   "vicuna-v15-13b")


class OpenVLAConfig(PretrainedConfig):
    """OpenVLA's config.json fields, plus two ways to size the vision backbones differently from
    the two timm ids OpenVLA uses: ``timm_overrides`` (timm keyword arguments per id, what the
    reference fixtures built by upstream code carry) and ``vit_specs`` (explicit ViT sizes, the
    tiny models built here)."""

    model_type = "openvla"
    sub_configs = {"text_config": LlamaConfig}

    def __init__(self, timm_model_ids: list[str] | None = None, vit_specs: list[dict] | None = None,
                 timm_overrides: list[dict] | None = None, image_sizes: list[int] | None = None,
                 use_fused_vision_backbone: bool = True, text_config: dict | LlamaConfig | None = None,
                 n_action_bins: int = 256, norm_stats: dict | None = None, pad_to_multiple_of: int = 64, **kwargs):
        # none in the file: the ones its vision_backbone_id names, as upstream's config derives them
        backbone = PRISMATIC_BACKBONES.get(kwargs.get("vision_backbone_id"), DINOSIGLIP)
        self.timm_model_ids = timm_model_ids or list(backbone)
        self.vit_specs = vit_specs
        self.timm_overrides = timm_overrides
        self.image_sizes = image_sizes or [224, 224]
        self.use_fused_vision_backbone = use_fused_vision_backbone
        if isinstance(text_config, dict):
            text_config = LlamaConfig(**text_config)
        self.text_config = text_config or LlamaConfig()
        self.n_action_bins = n_action_bins
        self.norm_stats = norm_stats
        self.pad_to_multiple_of = pad_to_multiple_of
        super().__init__(**kwargs)

    def vision_specs(self) -> list[ViTSpec]:
        if self.vit_specs:
            specs = [ViTSpec(**s) for s in self.vit_specs]
            for i, spec in enumerate(specs):
                check_heads(spec, f"vit_specs[{i}]")
        else:
            overrides = self.timm_overrides or [None] * len(self.timm_model_ids)
            specs = [timm_spec(i, size, o)
                     for i, size, o in zip(self.timm_model_ids, self.image_sizes, overrides, strict=False)]
        return specs if self.use_fused_vision_backbone else specs[:1]

    def check_supported(self, where: str) -> None:
        """A UserError for an option of config.json (at ``where``) this model does not implement."""
        self._check_vision_backbone_id(where)
        llm = getattr(self, "llm_backbone_id", None)
        if llm is not None and llm not in LLAMA_BACKBONES:
            raise UserError(f"{where}: llm_backbone_id={llm!r} is not a Llama; this project builds OpenVLA's "
                            f"language model as Llama only ({', '.join(LLAMA_BACKBONES)}), as every public OpenVLA "
                            "and OpenVLA-OFT checkpoint is. A Mistral or Phi Prismatic model is not supported.")
        if self.text_config.model_type != "llama":
            raise UserError(f"{where}: text_config.model_type={self.text_config.model_type!r}; only 'llama' is "
                            "supported (see llm_backbone_id).")
        check_llama_heads(self.text_config, where)
        rope = (self.text_config.rope_parameters or {}).get("rope_type", "default")
        if rope not in ROPE_TYPES:
            raise UserError(f"{where}: text_config.rope_scaling has type {rope!r}; supported: {list(ROPE_TYPES)} "
                            "(no scaling, or linear: what transformers 4.40.1, upstream's pin, computes as this "
                            "project does). Llama-2 OpenVLA checkpoints use no scaling.")
        acts = [a for a in getattr(self, "timm_override_act_layers", None) or [] if a is not None]
        if acts:
            raise UserError(f"{where}: timm_override_act_layers={acts}: the ViTs here use timm's default GELU; "
                            "a quick-GELU (CLIP) backbone is not supported.")
        needed = 2 if self.use_fused_vision_backbone else 1
        if not self.vit_specs and not needed <= len(self.timm_model_ids) <= 2:
            raise UserError(f"{where}: use_fused_vision_backbone={self.use_fused_vision_backbone} with "
                            f"timm_model_ids={self.timm_model_ids}: a fused backbone names two timm ids, a single "
                            "one names one (upstream allows at most two). The file was edited or is damaged.")
        try:  # (a size that is no multiple of the patch is fine: timm's patch conv drops the rest, as here)
            self.vision_specs()
        except UserError as err:  # the timm ids and overrides: say which file they are in
            raise UserError(f"{where}: {err}") from None
        if not 2 <= self.n_action_bins <= self.action_vocab_size:
            raise UserError(f"{where}: n_action_bins={self.n_action_bins} must be between 2 and the vocabulary's "
                            f"{self.action_vocab_size} ids. Use the checkpoint's own config.json.")

    def _check_vision_backbone_id(self, where: str) -> None:
        """Upstream's config refuses a ``vision_backbone_id`` outside Prismatic's list (configs built
        here, with ``vit_specs``, have none)."""
        backbone = getattr(self, "vision_backbone_id", None)
        if backbone is not None and backbone not in PRISMATIC_BACKBONES:
            err = unknown_name_error("Prismatic vision backbone (vision_backbone_id)", str(backbone),
                                     list(PRISMATIC_BACKBONES))
            raise UserError(f"{where}: {err} Upstream's OpenVLAConfig refuses it too: copy config.json again from "
                            "the checkpoint it belongs to (every public OpenVLA and OFT checkpoint has "
                            "dinosiglip-vit-so-224px).")

    @property
    def action_vocab_size(self) -> int:
        """The vocabulary whose last ``n_action_bins`` ids are the action tokens: the Llama vocabulary
        before its padding to a multiple of 64 (32000 of 32064), as ``predict_action`` computes it."""
        return self.text_config.vocab_size - self.pad_to_multiple_of


def check_llama_heads(text: LlamaConfig, where: str) -> None:
    """The query heads a multiple of the key-value heads: grouped-query attention repeats each key-value
    head for a whole group, so other counts fail at the first step. (A ``hidden_size`` that is no multiple
    of the heads transformers' LlamaConfig refuses itself, as upstream's 4.40.1 Llama does.)"""
    heads, kv = text.num_attention_heads, text.num_key_value_heads or text.num_attention_heads
    if kv < 1 or heads % kv:
        raise UserError(f"{where}: text_config.num_attention_heads={heads} is not a multiple of "
                        f"text_config.num_key_value_heads={kv}: grouped-query attention shares each key-value head "
                        "among a whole group of query heads. Copy config.json again from the checkpoint it "
                        "belongs to.")


class PrismaticVisionBackbone(nn.Module):
    """``featurizer`` (DINOv2) and, fused, ``fused_featurizer`` (SigLIP): features concatenated."""

    def __init__(self, specs: list[ViTSpec]):
        super().__init__()
        self.featurizer = VisionTransformer(specs[0])
        self.fused_featurizer = VisionTransformer(specs[1]) if len(specs) > 1 else None
        self.embed_dim = sum(s.dim for s in specs)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C * N, H, W]`` (``N`` images of ``C`` = 3 or, fused, 6 channels) -> ``[B, N * P, embed_dim]``:
        each image's patches in turn (OFT's multi-image input: agentview, then wrist)."""
        channels = 3 if self.fused_featurizer is None else 6
        return torch.cat([self._features(image) for image in torch.split(pixel_values, channels, dim=1)], dim=1)

    def _features(self, image: torch.Tensor) -> torch.Tensor:
        if self.fused_featurizer is None:
            return self.featurizer(image)
        dino, siglip = torch.split(image, 3, dim=1)
        return torch.cat([self.featurizer(dino), self.fused_featurizer(siglip)], dim=-1)


class PrismaticProjector(nn.Module):
    """Fused: ``fc1 (vision -> 4 * vision), GELU, fc2 (-> llm), GELU, fc3 (llm -> llm)``;
    single backbone: ``fc1 (vision -> llm), GELU, fc2 (llm -> llm)`` (Prismatic's two MLPs)."""

    def __init__(self, vision_dim: int, llm_dim: int, fused: bool = True):
        super().__init__()
        width = 4 * vision_dim if fused else llm_dim
        self.fc1 = nn.Linear(vision_dim, width)
        self.fc2 = nn.Linear(width, llm_dim)
        self.fc3 = nn.Linear(llm_dim, llm_dim) if fused else None
        self.act = nn.GELU()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.fc2(self.act(self.fc1(patches)))
        return x if self.fc3 is None else self.fc3(self.act(x))


class OpenVLAForActionPrediction(PreTrainedModel):
    config_class = OpenVLAConfig
    base_model_prefix = ""  # checkpoint keys start at vision_backbone / projector / language_model
    _no_split_modules = ["LlamaDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: OpenVLAConfig):
        super().__init__(config)
        self.vision_backbone = PrismaticVisionBackbone(config.vision_specs())
        self.projector = PrismaticProjector(self.vision_backbone.embed_dim, config.text_config.hidden_size,
                                            fused=config.use_fused_vision_backbone)
        self.language_model = LlamaForCausalLM(config.text_config)
        self.post_init()

    @property
    def num_patches(self) -> int:
        """Patch tokens per image."""
        return self.vision_backbone.featurizer.num_patches

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def multimodal_embeddings(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                              attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[BOS] + patches + prompt[1:]`` embeddings ``[B, 1 + P + L - 1, D]`` and their mask."""
        patches = self.projector(self.vision_backbone(pixel_values.to(self.projector.fc1.weight.dtype)))
        text = self.get_input_embeddings()(input_ids)
        embeds = torch.cat([text[:, :1], patches, text[:, 1:]], dim=1)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        patch_mask = attention_mask.new_ones(patches.shape[:2])
        return embeds, torch.cat([attention_mask[:, :1], patch_mask, attention_mask[:, 1:]], dim=1)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs):
        embeds, mask = self.multimodal_embeddings(input_ids, pixel_values, attention_mask)
        return self.language_model(inputs_embeds=embeds, attention_mask=mask, **kwargs)


TINY_PATCH = 8  # the tiny models' ViT patch size (px)


def tiny_config(vocab_size: int, image_size: int = 64, patch: int = TINY_PATCH, vision_dim: int = 64,
                hidden: int = 128, layers: int = 2) -> OpenVLAConfig:
    """A few-million-parameter OpenVLA with the real architecture (fused DINOv2-style and
    SigLIP-style ViTs of 3 blocks, projector, Llama): for CPU runs and tests."""

    def vit(dinov2: bool) -> dict:
        return {"dim": vision_dim, "depth": 3, "heads": 2, "mlp_dim": 2 * vision_dim, "patch": patch,
                "image_size": image_size, "class_token": dinov2, "reg_tokens": 4 if dinov2 else 0,
                "layer_scale": dinov2, "attn_pool": not dinov2}

    text = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=1024, rms_norm_eps=1e-6)
    return OpenVLAConfig(vit_specs=[vit(True), vit(False)], image_sizes=[image_size, image_size],
                         text_config=text.to_dict(), pad_to_multiple_of=0)  # the vocabulary is not padded


def read_config(model_dir: str) -> OpenVLAConfig:
    """``model_dir``'s config.json as an :class:`OpenVLAConfig`, every option checked
    (:meth:`OpenVLAConfig.check_supported`); no weights are read."""
    config = read_pretrained_config(OpenVLAConfig, model_dir, "an OpenVLA")
    config.check_supported(str(Path(model_dir) / "config.json"))
    return config
