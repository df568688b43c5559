"""Build tiny OpenVLA / OpenVLA-OFT checkpoints with the upstream code and record what it computes.

Runs in the throwaway reference venv that ``make_fixtures.sh`` makes (transformers 4.40.1,
timm 0.9.10, tokenizers 0.19.1, torch 2.14.1 + torchvision 0.29.1, tensorflow-cpu), never in
the project's venv, and imports the upstream sources from the fetched snapshots:

- ``openvla``: openvla/openvla's ``prismatic/extern/hf`` (config, model, processor) with stock
  transformers 4.40.1, and its LIBERO eval helpers (``experiments/robot``) for the eval images;
- ``oft``: moojink/openvla-oft's ``prismatic/extern/hf``, action heads, projectors and eval
  helpers, with moojink/transformers-openvla-oft (bidirectional Llama attention) on
  ``PYTHONPATH`` in place of stock transformers;
- ``simplevla``: PRIME-RL/SimpleVLA-RL's batched rollout on the token OFT fixture;
- ``openvla_single``, ``oft_aloha``, ``oft_proprio_mask``: checkpoints of the upstream options the
  first ones do not use (:class:`Shape`: one SigLIP backbone, letterbox / resize-crop processors,
  grouped-query attention, RoPE scaling, vocabulary padding, action bins; OFT's ALOHA constants
  with min / max normalisation, 25 x 14 chunks and three cameras; a proprio mask).

Each upstream ``prismatic`` package is loaded through a shim package (:func:`upstream_package`)
holding symlinks to just the modules inference needs, because the packages' ``__init__`` files
import their whole training stack (draccus, dlimp, RLDS). A module inference never calls but an
upstream file imports (``libero``, ``dlimp``) is an empty stub.

Sizes are tiny (hidden 16-32, ViTs of 3-4 blocks) but everything else is the public on-disk format:
config.json with ``auto_map``, bf16 safetensors, ``preprocessor_config.json`` written by
upstream's processor under bf16 default dtype (so its DINOv2 normalisation is bf16-rounded, as
in openvla-7b's), SentencePiece tokenizer files, ``dataset_statistics.json``, OFT's
``action_head--*_checkpoint.pt`` / ``proprio_projector--*_checkpoint.pt`` with DDP's
``module.`` prefix. ViT sizes ride in config.json as ``timm_overrides`` (timm keyword
arguments over the two public timm ids), the one field public checkpoints do not have.

Usage (from make_fixtures.sh): ``python build_fixtures.py <family> --src <upstream snapshot> --out assets/reference``
"""

from __future__ import annotations

import argparse
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


def build_openvla(src: Path, out_root: Path) -> None:
    hf = import_openvla(src, Shape())
    openvla_utils, libero_utils = hf.utils, hf.libero
    out = out_root / "openvla_tiny"
    save_checkpoint(hf, out, seed=0)
    model, processor = load_upstream(hf, out)
    inputs = load_inputs(out_root)
    cases = {
        "libero_raw": (inputs["libero_agentview"], str(inputs["libero_instruction"])),
        "libero_eval": (eval_image(openvla_utils, libero_utils, inputs["libero_agentview"], True),
                        str(inputs["libero_instruction"])),
        "maniskill": (inputs["maniskill_rgb"], str(inputs["maniskill_instruction"])),
        "gradient": (inputs["gradient"], "Put The Bowl On The Stove"),
    }
    results = {}
    for name, (image, instruction) in cases.items():
        row = openvla_case(model, processor, image, instruction)
        row["env_action"] = libero_env_action(hf.robot_utils, row["action"])
        results.update({f"{name}/{k}": v for k, v in row.items()})
    np.savez_compressed(out_root / "openvla_tiny_outputs.npz", **results)
    print(f"openvla: {len(cases)} cases -> {out_root / 'openvla_tiny_outputs.npz'}")


# the fourth fixture: OpenVLA options the first one does not use
SINGLE = Shape(
    vision_backbone_id="siglip-vit-so400m", llm_backbone_id="vicuna-v15-7b", arch_specifier="no-align+gelu-mlp",
    image_resize_strategy="letterbox", timm_overrides=({"embed_dim": 40, "depth": 4, "num_heads": 2},),
    text_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "rope_scaling": {"type": "linear", "factor": 2.0}, "vocab_size": 32032,
                 "pad_token_id": 32000, "torch_dtype": "bfloat16"},
    pad_to_multiple_of=32, n_action_bins=128, unnorm_key="libero_10_no_noops")
LONG_INSTRUCTION = ("Pick up the black bowl between the plate and the ramekin, open the top drawer of the wooden "
                    "cabinet, put the alphabet soup and the tomato sauce in the basket, turn on the stove and put "
                    "the bowl on it, push the cube to the goal region, then stack the red cube onto the green cube "
                    "and close the drawers")
NON_ASCII_INSTRUCTION = "Mets le bol noir sur l'assiette à côté du ramequin — 把碗放在盘子上"


def build_openvla_single(src: Path, out_root: Path) -> None:
    """One SigLIP backbone (``use_fused_vision_backbone: false``, its two-layer projector), letterbox
    resizing, grouped-query attention, linear RoPE scaling, a vocabulary padded to a multiple of 32,
    128 action bins, 3 layers; plus prompts of 300 bytes and of non-ASCII text."""
    assert len(LONG_INSTRUCTION.encode()) == 300
    hf = import_openvla(src, SINGLE)
    out = out_root / "openvla_single_tiny"
    save_checkpoint(hf, out, seed=4, shape=SINGLE)
    model, processor = load_upstream(hf, out)
    assert not model.config.use_fused_vision_backbone and processor.image_processor.tvf_do_letterbox
    inputs = load_inputs(out_root)
    cases = {
        "libero_eval": (eval_image(hf.utils, hf.libero, inputs["libero_agentview"], True),
                        str(inputs["libero_instruction"])),
        "maniskill": (inputs["maniskill_rgb"], str(inputs["maniskill_instruction"])),
        "gradient": (inputs["gradient"], "Put The Bowl On The Stove"),  # letterboxed: 30 rows above and below
        # 180 x 177: one column each side, then 179 -> 224 makes 225 rows, centre-cropped to 224
        "gradient_odd": (np.ascontiguousarray(inputs["gradient"][:, :177]), "open the middle drawer"),
        "long_instruction": (inputs["maniskill_rgb"], LONG_INSTRUCTION),
        "non_ascii": (inputs["gradient"], NON_ASCII_INSTRUCTION),
    }
    results = {}
    for name, (image, instruction) in cases.items():
        row = openvla_case(model, processor, image, instruction, SINGLE)
        row["env_action"] = libero_env_action(hf.robot_utils, row["action"])
        results.update({f"{name}/{k}": v for k, v in row.items()})
    results.update(resize_crop_case(hf, {name: cases[name][0] for name in ("maniskill", "gradient", "gradient_odd")}))
    np.savez_compressed(out_root / "openvla_single_tiny_outputs.npz", **results)
    print(f"openvla single: {len(cases)} cases -> {out_root / 'openvla_single_tiny_outputs.npz'}")


def resize_crop_case(hf, frames: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Prismatic's third ``image_resize_strategy``, ``resize-crop`` (shorter side to 224, centre crop),
    for the single SigLIP backbone: the processor's saved JSON and its pixel values on ``frames``."""
    from PIL import Image

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        processor = hf.PrismaticImageProcessor(
            use_fused_vision_backbone=False, image_resize_strategy="resize-crop", input_sizes=[(3, 224, 224)],
            interpolations=["bicubic"], means=[(0.5, 0.5, 0.5)], stds=[(0.5, 0.5, 0.5)])
    finally:
        torch.set_default_dtype(default)
    processor.auto_map = PROCESSOR_AUTO_MAP
    processor.processor_class = "PrismaticProcessor"
    with tempfile.TemporaryDirectory() as scratch:  # what save_pretrained writes, read back as from_pretrained does
        processor.save_pretrained(scratch)
        saved = (Path(scratch) / "preprocessor_config.json").read_text()
        processor = hf.PrismaticImageProcessor.from_pretrained(scratch)
    out = {"resize_crop/preprocessor_config": np.array(saved)}
    for name, frame in frames.items():
        out[f"resize_crop/{name}/pixel_values"] = processor(Image.fromarray(frame).convert("RGB"))["pixel_values"][0]
    return out


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


@torch.no_grad()
def openvla_case(model, processor, image: np.ndarray, instruction: str, shape: Shape | None = None) -> dict:
    """Upstream's ``get_vla_action`` for one frame (fp32), plus the teacher-forced logits."""
    from PIL import Image

    shape = shape or Shape()
    dims = shape.action_dim
    prompt = f"In: What action should the robot take to {instruction.lower()}?\nOut:"
    batch = processor(prompt, Image.fromarray(image).convert("RGB"))
    action = model.predict_action(**batch, unnorm_key=shape.unnorm_key, do_sample=False)
    ids = torch.cat([batch["input_ids"], torch.tensor([[29871]])], dim=1)
    generated = model.generate(ids, pixel_values=batch["pixel_values"], attention_mask=torch.ones_like(ids),
                               max_new_tokens=dims, do_sample=False)[0, ids.shape[1]:]
    full = torch.cat([ids, generated[None, :-1]], dim=1)
    logits = model(input_ids=full, pixel_values=batch["pixel_values"], attention_mask=torch.ones_like(full)).logits
    return {"image": image, "instruction": np.array(instruction), "pixel_values": batch["pixel_values"][0].numpy(),
            "input_ids": batch["input_ids"][0].numpy(), "generated_ids": generated.numpy(),
            "logits": logits[0, -dims:, shape.logit_ids].numpy(), "action": np.asarray(action, dtype=np.float64)}


# -- OpenVLA-OFT ----------------------------------------------------------------------------
OFT_MODULES = ["extern/hf", "vla/constants.py", "training/train_utils.py", "models/action_heads.py",
               "models/projectors.py", "models/film_vit_wrapper.py"]


def import_oft(src: Path, shape: Shape | None = None) -> types.SimpleNamespace:
    """moojink/openvla-oft's model, heads and eval helpers, with the constants of the platform its
    ``detect_robot_platform`` reads from the command line (LIBERO: 8 x 7 chunks, 8-dim proprio, q01 / q99;
    ALOHA: 25 x 14, 14-dim proprio, min / max)."""
    import transformers

    assert "transformers-openvla-oft" in transformers.__file__, (
        "OFT must run with moojink/transformers-openvla-oft on PYTHONPATH (bidirectional attention); "
        f"got {transformers.__file__}")
    root = upstream_package(src, OFT_MODULES)
    sys.path.insert(0, str(root))
    tiny_timm((shape or Shape()).tiny_vits())
    from prismatic.vla.constants import NormalizationType

    stub_modules("prismatic.vla.datasets", "prismatic.vla.datasets.rlds", "prismatic.vla.datasets.rlds.utils",
                 "prismatic.vla.datasets.rlds.utils.data_utils", "libero", "libero.libero", "libero.libero.envs")
    sys.modules["prismatic.vla.datasets.rlds.utils.data_utils"].NormalizationType = NormalizationType
    sys.modules["libero.libero"].get_libero_path = None
    sys.modules["libero.libero.envs"].OffScreenRenderEnv = None
    import prismatic.extern.hf.configuration_prismatic as configuration
    import prismatic.extern.hf.modeling_prismatic as modeling
    import prismatic.extern.hf.processing_prismatic as processing
    from experiments.robot import openvla_utils, robot_utils
    from experiments.robot.libero import libero_utils
    from prismatic.models.action_heads import L1RegressionActionHead
    from prismatic.models.projectors import ProprioProjector

    return types.SimpleNamespace(OpenVLAConfig=configuration.OpenVLAConfig,
                                 OpenVLAForActionPrediction=modeling.OpenVLAForActionPrediction,
                                 PrismaticImageProcessor=processing.PrismaticImageProcessor,
                                 PrismaticProcessor=processing.PrismaticProcessor, utils=openvla_utils,
                                 libero=libero_utils, robot_utils=robot_utils,
                                 L1RegressionActionHead=L1RegressionActionHead,
                                 ProprioProjector=ProprioProjector)


def save_component(module: torch.nn.Module, path: Path, seed: int) -> None:
    """An OFT component file: bf16 weights under DDP's ``module.`` prefix, as OFT's training saves them."""
    randomize_module(module, seed)
    torch.save({f"module.{k}": v.to(torch.bfloat16) for k, v in module.state_dict().items()}, path)


def randomize_module(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "norm" in name or "layer_norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_oft(src: Path, out_root: Path) -> None:
    oft = import_oft(src)
    inputs = load_inputs(out_root)
    cases = oft_cases(oft, inputs)
    for variant, seed in (("l1", 1), ("token", 2)):
        out = out_root / f"openvla_oft_{variant}_tiny"
        model, _ = save_checkpoint(oft, out, seed=seed)
        hidden = TEXT_CONFIG["hidden_size"]
        if variant == "l1":
            save_component(oft.L1RegressionActionHead(input_dim=hidden, hidden_dim=hidden, action_dim=7),
                           out / f"action_head--{STEP}_checkpoint.pt", seed + 10)
            save_component(oft.ProprioProjector(llm_dim=hidden, proprio_dim=8),
                           out / f"proprio_projector--{STEP}_checkpoint.pt", seed + 20)
        model, processor = load_upstream(oft, out)
        heads = load_oft_components(oft, out, hidden) if variant == "l1" else {}
        images = 2 if variant == "l1" else 1  # L1: agentview + wrist; token (discrete path): one image
        model.vision_backbone.set_num_images_in_input(images)
        results = {}
        for name, case in cases.items():
            row = oft_case(oft, model, processor, heads, case, images)
            row["env_actions"] = libero_env_action(oft.robot_utils, row["actions"])
            results.update({f"{name}/{k}": v for k, v in row.items()})
        np.savez_compressed(out_root / f"openvla_oft_{variant}_tiny_outputs.npz", **results)
        print(f"oft {variant}: {len(cases)} cases -> {out_root / f'openvla_oft_{variant}_tiny_outputs.npz'}")


# the L1 fixtures of OFT options the first two do not use; masks leave the grippers un-normalised
GRIPPER_MASKED = (True,) * 6 + (False,)
ALOHA = Shape(  # OFT's ALOHA constants: 25 x 14 chunks, 14-dim proprio, min / max bounds; 3 cameras, 1 layer
    timm_overrides=({"embed_dim": 24, "depth": 3, "num_heads": 2}, {"embed_dim": 32, "depth": 4, "num_heads": 2}),
    text_config={"hidden_size": 16, "intermediate_size": 40, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "vocab_size": 32064, "pad_token_id": 32000, "torch_dtype": "bfloat16"},
    unnorm_key="aloha1_put_x_into_pot_300_demos", action_dim=14, action_mask=GRIPPER_MASKED * 2,
    proprio_dim=14, proprio_mask=GRIPPER_MASKED * 2)
PROPRIO_MASK = Shape(  # LIBERO constants (q01 / q99), a proprio mask, one camera, GQA, linear RoPE scaling
    text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "rope_scaling": {"type": "linear", "factor": 4.0}, "vocab_size": 32064,
                 "pad_token_id": 32000, "torch_dtype": "bfloat16"},
    proprio_mask=(True,) * 6 + (False, False))


def build_oft_aloha(src: Path, out_root: Path) -> None:
    """``openvla_oft_aloha_tiny``: run as ``build_fixtures.py oft_aloha``, so OFT's constants are ALOHA's
    (its ``detect_robot_platform`` looks for "aloha" in the command line)."""
    oft = import_oft(src, ALOHA)
    from prismatic.vla.constants import ACTION_PROPRIO_NORMALIZATION_TYPE, NUM_ACTIONS_CHUNK

    assert NUM_ACTIONS_CHUNK == 25 and ACTION_PROPRIO_NORMALIZATION_TYPE == "bounds", "not ALOHA's constants"
    inputs = load_inputs(out_root)
    rng = np.random.default_rng(5)
    cases = {  # ALOHA's prepare_observation resizes every camera to 224 (JPEG + lanczos3) before get_vla_action
        "aloha_libero_frames": [inputs["libero_agentview"], inputs["libero_wrist"], inputs["maniskill_rgb"]],
        "aloha_other_frames": [inputs["gradient"], inputs["maniskill_rgb"], inputs["libero_wrist"]],
    }
    cases = {name: {"frames": [oft.utils.resize_image_for_policy(f, 224) for f in frames],
                    "state": rng.uniform(-1.5, 1.5, 14), "instruction": text}
             for (name, frames), text in zip(cases.items(), ["put the x into the pot", "Fold The Shirt"], strict=True)}
    build_oft_l1(oft, out_root / "openvla_oft_aloha_tiny", ALOHA, cases, images=3, seed=6)


def build_oft_proprio_mask(src: Path, out_root: Path) -> None:
    """``openvla_oft_proprio_mask_tiny``: LIBERO constants, proprio statistics with a mask, one camera."""
    oft = import_oft(src, PROPRIO_MASK)
    cases = oft_cases(oft, load_inputs(out_root))
    build_oft_l1(oft, out_root / "openvla_oft_proprio_mask_tiny", PROPRIO_MASK, cases, images=1, seed=7)


def build_oft_l1(oft, out: Path, shape: Shape, cases: dict, images: int, seed: int) -> None:
    """An L1-head OFT checkpoint of ``shape`` and upstream's ``get_vla_action`` on ``cases``."""
    save_checkpoint(oft, out, seed=seed, shape=shape)
    hidden = shape.text_config["hidden_size"]
    save_component(oft.L1RegressionActionHead(input_dim=hidden, hidden_dim=hidden, action_dim=shape.action_dim),
                   out / f"action_head--{STEP}_checkpoint.pt", seed + 10)
    save_component(oft.ProprioProjector(llm_dim=hidden, proprio_dim=shape.proprio_dim),
                   out / f"proprio_projector--{STEP}_checkpoint.pt", seed + 20)
    model, processor = load_upstream(oft, out)
    heads = load_oft_components(oft, out, hidden, shape)
    model.vision_backbone.set_num_images_in_input(images)
    results = {}
    for name, case in cases.items():
        row = oft_case(oft, model, processor, heads, case, images, shape.unnorm_key)
        results.update({f"{name}/{k}": v for k, v in row.items()})
    path = out.parent / f"{out.name}_outputs.npz"
    np.savez_compressed(path, **results)
    print(f"oft {out.name}: {len(cases)} cases -> {path}")


def load_oft_components(oft, out: Path, hidden: int, shape: Shape | None = None) -> dict:
    """The action head and proprio projector as OFT's eval loads them (find file, strip ``module.``)."""
    shape = shape or Shape()
    head = oft.L1RegressionActionHead(input_dim=hidden, hidden_dim=hidden, action_dim=shape.action_dim)
    head.load_state_dict(oft.utils.load_component_state_dict(oft.utils.find_checkpoint_file(str(out), "action_head")))
    proprio = oft.ProprioProjector(llm_dim=hidden, proprio_dim=shape.proprio_dim)
    proprio.load_state_dict(oft.utils.load_component_state_dict(
        oft.utils.find_checkpoint_file(str(out), "proprio_projector")))
    return {"action_head": head.float().eval(), "proprio_projector": proprio.float().eval()}


def oft_cases(oft, inputs: dict) -> dict:
    """OFT's LIBERO ``prepare_observation`` on the captured frame (rotate 180, JPEG + lanczos3 to 224),
    and two frames of other sizes that ``prepare_images_for_vla`` resizes itself."""
    raw = {"agentview_image": np.ascontiguousarray(inputs["libero_agentview"][::-1]),
           "robot0_eye_in_hand_image": np.ascontiguousarray(inputs["libero_wrist"][::-1])}
    libero = {"frames": [oft.utils.resize_image_for_policy(oft.libero.get_libero_image(raw), 224),
                         oft.utils.resize_image_for_policy(oft.libero.get_libero_wrist_image(raw), 224)],
              "state": inputs["libero_state"].astype(np.float64), "instruction": str(inputs["libero_instruction"])}
    rng = np.random.default_rng(3)
    return {
        "libero_eval": libero,
        "maniskill": {"frames": [inputs["maniskill_rgb"], inputs["gradient"]],
                      "state": rng.uniform(-1.5, 1.5, 8), "instruction": str(inputs["maniskill_instruction"])},
        "gradient": {"frames": [inputs["gradient"], inputs["maniskill_rgb"]],
                     "state": rng.uniform(-1.5, 1.5, 8), "instruction": "Put The Bowl On The Stove"},
    }


@torch.no_grad()
def oft_case(oft, model, processor, heads: dict, case: dict, images: int, unnorm_key: str = UNNORM_KEY) -> dict:
    """OFT's ``get_vla_action`` for one observation, step by step in fp32 (upstream casts the
    inputs to bf16 for its bf16 model; here model and inputs stay fp32). ``case["frames"]``: the
    full image, then the wrist images in the order ``get_vla_action`` takes them."""
    cfg = types.SimpleNamespace(num_images_in_input=images, center_crop=True, use_proprio=bool(heads),
                                unnorm_key=unnorm_key)
    all_images = case["frames"][:images]
    pil = oft.utils.prepare_images_for_vla(all_images, cfg)
    prompt = f"In: What action should the robot take to {case['instruction'].lower()}?\nOut:"
    batch = processor(prompt, pil[0])
    if images > 1:
        batch["pixel_values"] = torch.cat([batch["pixel_values"]] + [processor(prompt, im)["pixel_values"]
                                                                     for im in pil[1:]], dim=1)
    proprio = None
    if heads:
        proprio = oft.utils.normalize_proprio(case["state"], model.norm_stats[unnorm_key]["proprio"])
    actions, hidden = model.predict_action(**batch, unnorm_key=unnorm_key, do_sample=False, proprio=proprio,
                                           **heads)
    row = {"images": np.stack([np.array(p) for p in pil]), "instruction": np.array(case["instruction"]),
           "state": np.asarray(case["state"]), "pixel_values": batch["pixel_values"][0].numpy(),
           "input_ids": batch["input_ids"][0].numpy(), "actions": np.asarray(actions, dtype=np.float64),
           "actions_hidden_states": hidden[0].float().numpy()}
    if proprio is not None:
        row["proprio"] = np.asarray(proprio)
    if not heads:
        row.update(oft_token_logits(model, batch))
    return row


def oft_token_logits(model, batch) -> dict:
    """The discrete path's logits at the 56 action positions (what ``predict_action`` argmaxes)."""
    from prismatic.vla.constants import ACTION_DIM, NUM_ACTIONS_CHUNK

    ids = torch.cat([batch["input_ids"], torch.tensor([[29871]])], dim=1)
    tokens = ACTION_DIM * NUM_ACTIONS_CHUNK
    mask = torch.ones_like(ids)
    ids, mask = model._prepare_input_for_action_prediction(ids, mask)
    labels = model._prepare_labels_for_action_prediction(torch.full_like(ids[:, :-tokens - 1], -100), ids)
    embeds = model.get_input_embeddings()(ids) * ~model._process_action_masks(labels).unsqueeze(-1)
    patches = model._process_vision_features(batch["pixel_values"])
    embeds, mask = model._build_multimodal_attention(embeds, patches, mask)
    out = model.language_model(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
    start = patches.shape[1] + ids.shape[1] - tokens - 2  # NUM_PATCHES + NUM_PROMPT_TOKENS
    logits = out.logits[0, start:start + tokens]
    return {"logits": logits[:, LOGIT_IDS].numpy(), "predicted_ids": logits.argmax(-1).numpy()}


# -- SimpleVLA-RL's batched token OFT rollout ---------------------------------------------------
def build_simplevla(src: Path, out_root: Path) -> None:
    """PRIME-RL/SimpleVLA-RL's ``generate_action_verl`` (greedy, its rollout's padding: right-pad,
    then a stable argsort moving pads left) on the token OFT fixture, the three cases in one batch."""
    import os

    os.environ["ROBOT_PLATFORM"] = "LIBERO"  # its constants.py reads this (else ALOHA's 25 x 14 chunks)
    root = Path(tempfile.mkdtemp(prefix="simplevla-"))
    (root / "simplevla_oft").symlink_to(src / "verl" / "utils" / "vla_utils" / "openvla_oft")
    sys.path.insert(0, str(root))
    tiny_timm()
    import simplevla_oft.modeling_prismatic as modeling
    import simplevla_oft.processing_prismatic as processing
    from torch.nn.utils.rnn import pad_sequence
    from transformers import AutoTokenizer

    out = out_root / "openvla_oft_token_tiny"
    config = modeling.OpenVLAConfig.from_pretrained(out)
    config.use_proprio, config.proprio_dim = False, 7  # what its fsdp_workers.py sets for LIBERO
    model = modeling.OpenVLAForActionPrediction.from_pretrained(out, config=config, torch_dtype=torch.float32,
                                                                attn_implementation="sdpa").eval()
    model.norm_stats = json.loads((out / "dataset_statistics.json").read_text())
    model.vision_backbone.set_num_images_in_input(1)
    processor = processing.PrismaticProcessor(image_processor=processing.PrismaticImageProcessor.from_pretrained(out),
                                              tokenizer=AutoTokenizer.from_pretrained(out))
    cases = dict(np.load(out_root / "openvla_oft_token_tiny_outputs.npz"))
    names = ["libero_eval", "maniskill", "gradient"]
    ids, masks, pixels = [], [], []
    for name in names:  # rob_rollout.py's per-observation steps (frames already prepared as upstream's eval does)
        from PIL import Image

        prompt = f"In: What action should the robot take to {str(cases[name + '/instruction']).lower()}?\nOut:"
        batch = processor(prompt, Image.fromarray(cases[name + "/images"][0]))
        row = torch.cat([batch["input_ids"], torch.tensor([[29871]])], dim=1)
        ids.append(row.T)
        masks.append(torch.cat([batch["attention_mask"], torch.ones(1, 1, dtype=torch.long)], dim=1).T)
        pixels.append(batch["pixel_values"])
    pad = processor.tokenizer.pad_token_id
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad).squeeze(-1)
    attention_mask = pad_sequence(masks, batch_first=True, padding_value=0).squeeze(-1)
    order = torch.argsort((~input_ids.ne(pad)).int(), dim=1, descending=True, stable=True)
    input_ids, attention_mask = torch.gather(input_ids, 1, order), torch.gather(attention_mask, 1, order)
    captured = []  # the language model's logits, for the same slice generate_action_verl argmaxes
    model.language_model.register_forward_hook(lambda module, args, output: captured.append(output.logits))
    with torch.no_grad():
        actions, response = model.generate_action_verl(
            input_ids=input_ids, pixel_values=torch.cat(pixels), attention_mask=attention_mask, padding_idx=pad,
            do_sample=False, unnorm_key=UNNORM_KEY, temperature=1.0)
    start = input_ids.ne(pad).sum(1) - 1 + model.vision_backbone.get_num_patches()  # its seq_indices
    rows = torch.arange(len(names))[:, None]
    logits = captured[0][rows, start[:, None] + torch.arange(response.shape[1])[None], LOGIT_IDS]
    np.savez_compressed(out_root / "openvla_oft_token_tiny_simplevla_outputs.npz", cases=np.array(names),
                        input_ids=input_ids.numpy(), attention_mask=attention_mask.numpy(), logits=logits.numpy(),
                        response_ids=np.asarray(response), actions=np.asarray(actions, dtype=np.float64))
    print(f"simplevla: batch of {len(names)} -> {out_root / 'openvla_oft_token_tiny_simplevla_outputs.npz'}")


FAMILIES = {"openvla": build_openvla, "oft": build_oft, "simplevla": build_simplevla,
            "openvla_single": build_openvla_single, "oft_aloha": build_oft_aloha,
            "oft_proprio_mask": build_oft_proprio_mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=list(FAMILIES))
    parser.add_argument("--src", type=Path, required=True, help="the upstream repository's snapshot")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    FAMILIES[args.family](args.src, args.out)


if __name__ == "__main__":
    main()
