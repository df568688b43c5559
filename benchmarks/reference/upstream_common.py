"""What the fixture builders share (build_fixtures.py, oft_fixtures.py): the tiny shapes, the shim
packages that load upstream code, random weights, statistics and the checkpoint writers."""

from __future__ import annotations

import json
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tiny_tokenizer import save_llama_tokenizer  # noqa: E402

TIMM_OVERRIDES = [{"embed_dim": 32, "depth": 3, "num_heads": 2},  # vit_large_patch14_reg4_dinov2.lvd142m
                  {"embed_dim": 48, "depth": 3, "num_heads": 2}]  # vit_so400m_patch14_siglip_224
TEXT_CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 2, "vocab_size": 32064, "pad_token_id": 32000, "torch_dtype": "bfloat16"}
AUTO_MAP = {"AutoConfig": "configuration_prismatic.OpenVLAConfig",
            "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction"}
PROCESSOR_AUTO_MAP = {"AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
                      "AutoProcessor": "processing_prismatic.PrismaticProcessor"}
UNNORM_KEY = "libero_spatial_no_noops"
OTHER_KEY = "bridge_orig"
LOGIT_IDS = slice(31488, 32064)  # 256 text ids, the 256 action ids, the 64 padding ids
STEP = 100  # the training step in OFT's component file names
# upstream's vision_backbone_id -> timm ids and resolutions (configuration_prismatic.py), for the ids used here
VISION_BACKBONES = {
    "dinosiglip-vit-so-224px": (("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"), (224, 224)),
    "siglip-vit-so400m": (("vit_so400m_patch14_siglip_224",), (224,)),
}
# timm's data config of each ViT id: normalisation mean and std
BACKBONE_DATA = {"vit_large_patch14_reg4_dinov2.lvd142m": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
                 "vit_so400m_patch14_siglip_224": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}


@dataclass(frozen=True)
class Shape:
    """What one fixture checkpoint is: the defaults are the first three fixtures' (openvla-7b's layout
    at tiny sizes, LIBERO statistics); the later fixtures change sizes and upstream options."""

    vision_backbone_id: str = "dinosiglip-vit-so-224px"
    llm_backbone_id: str = "llama2-7b-pure"
    arch_specifier: str = "no-align+fused-gelu-mlp"
    image_resize_strategy: str = "resize-naive"
    timm_overrides: tuple[dict, ...] = tuple(TIMM_OVERRIDES)
    text_config: dict = field(default_factory=lambda: dict(TEXT_CONFIG))
    pad_to_multiple_of: int = 64
    n_action_bins: int = 256
    unnorm_key: str = UNNORM_KEY
    action_dim: int = 7
    action_mask: tuple[bool, ...] | None = (True,) * 6 + (False,)
    proprio_dim: int = 8
    proprio_mask: tuple[bool, ...] | None = None

    @property
    def timm_ids(self) -> tuple[str, ...]:
        return VISION_BACKBONES[self.vision_backbone_id][0]

    @property
    def image_sizes(self) -> tuple[int, ...]:
        return VISION_BACKBONES[self.vision_backbone_id][1]

    @property
    def fused(self) -> bool:
        return len(self.timm_ids) > 1

    @property
    def action_ids(self) -> tuple[int, int]:
        """``[first, end)``: the last ``n_action_bins`` ids before the vocabulary's padding."""
        end = self.text_config["vocab_size"] - self.pad_to_multiple_of
        return end - self.n_action_bins, end

    @property
    def logit_ids(self) -> slice:
        """What a fixture keeps of the vocabulary: 256 text ids, the action ids, the padding ids."""
        return slice(self.action_ids[0] - 256, self.text_config["vocab_size"])

    def tiny_vits(self) -> dict[str, dict]:
        return dict(zip(self.timm_ids, self.timm_overrides, strict=True))


# -- importing upstream code ------------------------------------------------------------------
def upstream_package(src: Path, modules: list[str]) -> Path:
    """A directory with a ``prismatic`` package whose listed modules are symlinks into ``src``."""
    root = Path(tempfile.mkdtemp(prefix="upstream-"))
    for module in modules:
        target = root / "prismatic" / module
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(src / "prismatic" / module)
    for d in [p for p in (root / "prismatic").rglob("*") if p.is_dir() and not p.is_symlink()] + [root / "prismatic"]:
        (d / "__init__.py").touch()
    (root / "experiments").symlink_to(src / "experiments")
    return root


def stub_modules(*names: str) -> None:
    """Empty modules for imports upstream files make but inference never uses."""
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module


def tiny_timm(overrides: dict[str, dict] | None = None) -> None:
    """``timm.create_model`` builds the public ViT ids at tiny sizes (default: the two fused ids at
    :data:`TIMM_OVERRIDES` sizes; ``overrides``: timm id -> keyword arguments)."""
    import timm

    real = timm.create_model
    overrides = overrides or dict(zip(["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
                                      TIMM_OVERRIDES, strict=True))

    def create_model(name, *args, **kwargs):
        return real(name, *args, **{**kwargs, **overrides.get(name, {})})

    timm.create_model = create_model


# -- weights, statistics ------------------------------------------------------------------------
def randomize(model: torch.nn.Module, seed: int, action_ids: tuple[int, int] = (31744, 32000)) -> None:
    """Weights with some spread (upstream's init gives near-uniform logits at these sizes), and an
    lm_head that prefers the action ids ``[first, end)``, as a trained OpenVLA does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_factor"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.2)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2 and name.endswith("weight") and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            else:  # embeddings, position embeddings, cls / register tokens, pooling latents
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        head = model.language_model.lm_head.weight
        first, end = action_ids
        head[:first] *= 0.3
        head[end:] *= 0.3
        head[first:end] *= 2.0


def statistics(seed: int, shape: Shape | None = None) -> dict:
    """``dataset_statistics.json``: a LIBERO-like key (7-dim actions, gripper not normalised,
    8-dim proprio; other sizes and masks from ``shape``) and a second key, so ``unnorm_key`` must be named."""
    shape = shape or Shape()
    rng = np.random.default_rng(seed)

    def block(dim: int, mask: list[bool] | None) -> dict:
        low = -rng.uniform(0.2, 1.0, dim)
        high = rng.uniform(0.2, 1.0, dim)
        stats = {"mean": ((low + high) / 2).tolist(), "std": ((high - low) / 4).tolist(),
                 "max": (high * 1.2).tolist(), "min": (low * 1.2).tolist(), "q01": low.tolist(), "q99": high.tolist()}
        if mask is not None:
            stats["mask"] = list(mask)
        return stats

    return {key: {"action": block(shape.action_dim, shape.action_mask),
                  "proprio": block(shape.proprio_dim, shape.proprio_mask), "num_transitions": 1000,
                  "num_trajectories": 50} for key in (shape.unnorm_key, OTHER_KEY)}


# -- checkpoints ----------------------------------------------------------------------------
def save_checkpoint(hf, out: Path, seed: int, shape: Shape | None = None):
    """The model, processor, tokenizer and statistics in openvla-7b's layout (sizes and options from
    ``shape``; default: the first three fixtures'); returns the model (fp32)."""
    shape = shape or Shape()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_llama_tokenizer(out)
    stats = statistics(seed, shape)
    config = hf.OpenVLAConfig(vision_backbone_id=shape.vision_backbone_id, llm_backbone_id=shape.llm_backbone_id,
                              arch_specifier=shape.arch_specifier, use_fused_vision_backbone=shape.fused,
                              image_resize_strategy=shape.image_resize_strategy, text_config=shape.text_config,
                              llm_max_length=2048, pad_token_id=32000, pad_to_multiple_of=shape.pad_to_multiple_of,
                              norm_stats=stats, n_action_bins=shape.n_action_bins, torch_dtype=torch.bfloat16,
                              timm_overrides=list(shape.timm_overrides))
    config.auto_map = AUTO_MAP
    config.architectures = ["OpenVLAForActionPrediction"]
    torch.manual_seed(seed)
    model = hf.OpenVLAForActionPrediction(config)
    randomize(model, seed, shape.action_ids)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "dataset_statistics.json").write_text(json.dumps(stats, indent=2))
    save_image_processor(hf, out, shape)
    return model.float(), tokenizer


def save_image_processor(hf, out: Path, shape: Shape | None = None) -> None:
    """``preprocessor_config.json`` as the HF conversion wrote it: under bf16 default dtype."""
    shape = shape or Shape()
    backbones = [BACKBONE_DATA[timm_id] for timm_id in shape.timm_ids]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        processor = hf.PrismaticImageProcessor(
            use_fused_vision_backbone=shape.fused, image_resize_strategy=shape.image_resize_strategy,
            input_sizes=[(3, size, size) for size in shape.image_sizes], interpolations=["bicubic"] * len(backbones),
            means=[mean for mean, _ in backbones], stds=[std for _, std in backbones])
    finally:
        torch.set_default_dtype(default)
    processor.auto_map = PROCESSOR_AUTO_MAP
    processor.processor_class = "PrismaticProcessor"
    processor.save_pretrained(out)


def load_upstream(hf, out: Path):
    """The checkpoint as upstream's eval scripts load it (fp32 here: the parity is exact, not bf16)."""
    from transformers import AutoTokenizer

    model = hf.OpenVLAForActionPrediction.from_pretrained(out, torch_dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
    norm_stats = json.loads((out / "dataset_statistics.json").read_text())
    model.norm_stats = norm_stats
    image_processor = hf.PrismaticImageProcessor.from_pretrained(out)
    processor = hf.PrismaticProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(out))
    return model, processor


# -- inputs -----------------------------------------------------------------------------------
def load_inputs(out: Path) -> dict:
    return dict(np.load(out / "inputs.npz"))


def eval_image(openvla_utils, libero_utils, upright: np.ndarray, center_crop: bool) -> np.ndarray:
    """What upstream's LIBERO eval feeds its processor for a frame: rotate 180 degrees (our env's
    frames are upright, LIBERO's raw ones upside down: raw = upright[::-1]), JPEG round trip and
    lanczos3 resize to 224, then the 90%-area centre crop."""
    from PIL import Image

    raw = np.ascontiguousarray(upright[::-1])
    img = libero_utils.get_libero_image({"agentview_image": raw}, 224)
    if center_crop:
        img = np.array(center_crop_openvla(openvla_utils, Image.fromarray(img)))
    return img


# -- OpenVLA --------------------------------------------------------------------------------
def import_openvla(src: Path, shape: Shape) -> types.SimpleNamespace:
    """openvla/openvla's model, processor and eval helpers, its ViTs at ``shape``'s tiny sizes."""
    root = upstream_package(src, ["extern/hf"])
    sys.path.insert(0, str(root))
    tiny_timm(shape.tiny_vits())
    stub_modules("libero", "libero.libero", "libero.libero.benchmark", "libero.libero.envs")
    sys.modules["libero.libero"].get_libero_path = None
    sys.modules["libero.libero.envs"].OffScreenRenderEnv = None
    import prismatic.extern.hf.configuration_prismatic as configuration
    import prismatic.extern.hf.modeling_prismatic as modeling
    import prismatic.extern.hf.processing_prismatic as processing
    from experiments.robot import openvla_utils, robot_utils
    from experiments.robot.libero import libero_utils

    return types.SimpleNamespace(robot_utils=robot_utils, OpenVLAConfig=configuration.OpenVLAConfig,
                                 OpenVLAForActionPrediction=modeling.OpenVLAForActionPrediction,
                                 PrismaticImageProcessor=processing.PrismaticImageProcessor,
                                 PrismaticProcessor=processing.PrismaticProcessor, utils=openvla_utils,
                                 libero=libero_utils)


def libero_env_action(robot_utils, action: np.ndarray) -> np.ndarray:
    """What run_libero_eval.py sends to LIBERO: gripper to [-1, 1], binarised, inverted."""
    return robot_utils.invert_gripper_action(robot_utils.normalize_gripper_action(action.copy(), binarize=True))


def center_crop_openvla(openvla_utils, image):
    """``get_vla_action``'s centre-crop branch (openvla/openvla experiments/robot/openvla_utils.py)."""
    import tensorflow as tf
    from PIL import Image

    image = tf.convert_to_tensor(np.array(image))
    orig_dtype = image.dtype
    image = tf.image.convert_image_dtype(image, tf.float32)
    image = openvla_utils.crop_and_resize(image, 0.9, 1)
    image = tf.clip_by_value(image, 0, 1)
    image = tf.image.convert_image_dtype(image, orig_dtype, saturate=True)
    return Image.fromarray(image.numpy()).convert("RGB")
