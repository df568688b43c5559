"""Build tiny OpenVLA / OpenVLA-OFT checkpoints with the upstream code and record what it computes.

Runs in the throwaway reference venv that ``make_fixtures.sh`` makes (transformers 4.40.1,
timm 0.9.10, tokenizers 0.19.1, torch 2.14.1 + torchvision 0.29.1, tensorflow-cpu), never in
the project's venv, and imports the upstream sources from the fetched snapshots:

- ``openvla``: openvla/openvla's ``prismatic/extern/hf`` (config, model, processor) with stock
  transformers 4.40.1, and its LIBERO eval helpers (``experiments/robot``) for the eval images;
- ``oft``: moojink/openvla-oft's ``prismatic/extern/hf``, action heads, projectors and eval
  helpers, with moojink/transformers-openvla-oft (bidirectional Llama attention) on
  ``PYTHONPATH`` in place of stock transformers.

Each upstream ``prismatic`` package is loaded through a shim package (:func:`upstream_package`)
holding symlinks to just the modules inference needs, because the packages' ``__init__`` files
import their whole training stack (draccus, dlimp, RLDS). A module inference never calls but an
upstream file imports (``libero``, ``dlimp``) is an empty stub.

Sizes are tiny (hidden 16, ViTs of 3 blocks) but everything else is the public on-disk format:
config.json with ``auto_map``, bf16 safetensors, ``preprocessor_config.json`` written by
upstream's processor under bf16 default dtype (so its DINOv2 normalisation is bf16-rounded, as
in openvla-7b's), SentencePiece tokenizer files, ``dataset_statistics.json``, OFT's
``action_head--*_checkpoint.pt`` / ``proprio_projector--*_checkpoint.pt`` with DDP's
``module.`` prefix. ViT sizes ride in config.json as ``timm_overrides`` (timm keyword
arguments over the two public timm ids), the one field public checkpoints do not have.

Usage (from make_fixtures.sh): ``python build_fixtures.py {openvla|oft} --out assets/reference``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
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


def tiny_timm() -> None:
    """``timm.create_model`` builds the two public ViT ids at :data:`TIMM_OVERRIDES` sizes."""
    import timm

    real = timm.create_model
    overrides = dict(zip(["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
                         TIMM_OVERRIDES, strict=True))

    def create_model(name, *args, **kwargs):
        return real(name, *args, **{**kwargs, **overrides.get(name, {})})

    timm.create_model = create_model


# -- weights, statistics ------------------------------------------------------------------------
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with some spread (upstream's init gives near-uniform logits at these sizes), and an
    lm_head that prefers the 256 action ids, as a trained OpenVLA does."""
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
        head[:31744] *= 0.3
        head[32000:] *= 0.3
        head[31744:32000] *= 2.0


def statistics(seed: int) -> dict:
    """``dataset_statistics.json``: a LIBERO-like key (7-dim actions, gripper not normalised,
    8-dim proprio) and a second key, so ``unnorm_key`` must be named."""
    rng = np.random.default_rng(seed)

    def block(dim: int, mask: list[bool] | None) -> dict:
        low = -rng.uniform(0.2, 1.0, dim)
        high = rng.uniform(0.2, 1.0, dim)
        stats = {"mean": ((low + high) / 2).tolist(), "std": ((high - low) / 4).tolist(),
                 "max": (high * 1.2).tolist(), "min": (low * 1.2).tolist(), "q01": low.tolist(), "q99": high.tolist()}
        if mask is not None:
            stats["mask"] = mask
        return stats

    mask = [True] * 6 + [False]
    return {key: {"action": block(7, mask), "proprio": block(8, None), "num_transitions": 1000,
                  "num_trajectories": 50} for key in (UNNORM_KEY, OTHER_KEY)}


# -- checkpoints ----------------------------------------------------------------------------
def save_checkpoint(hf, out: Path, seed: int):
    """The model, processor, tokenizer and statistics in openvla-7b's layout; returns the model (fp32)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_llama_tokenizer(out)
    stats = statistics(seed)
    config = hf.OpenVLAConfig(vision_backbone_id="dinosiglip-vit-so-224px", llm_backbone_id="llama2-7b-pure",
                              arch_specifier="no-align+fused-gelu-mlp", use_fused_vision_backbone=True,
                              image_resize_strategy="resize-naive", text_config=TEXT_CONFIG, llm_max_length=2048,
                              pad_token_id=32000, pad_to_multiple_of=64, norm_stats=stats, n_action_bins=256,
                              torch_dtype=torch.bfloat16, timm_overrides=TIMM_OVERRIDES)
    config.auto_map = AUTO_MAP
    config.architectures = ["OpenVLAForActionPrediction"]
    torch.manual_seed(seed)
    model = hf.OpenVLAForActionPrediction(config)
    randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "dataset_statistics.json").write_text(json.dumps(stats, indent=2))
    save_image_processor(hf, out)
    return model.float(), tokenizer


def save_image_processor(hf, out: Path) -> None:
    """``preprocessor_config.json`` as the HF conversion wrote it: under bf16 default dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        processor = hf.PrismaticImageProcessor(
            use_fused_vision_backbone=True, image_resize_strategy="resize-naive",
            input_sizes=[(3, 224, 224), (3, 224, 224)], interpolations=["bicubic", "bicubic"],
            means=[(0.485, 0.456, 0.406), (0.5, 0.5, 0.5)], stds=[(0.229, 0.224, 0.225), (0.5, 0.5, 0.5)])
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
def build_openvla(src: Path, out_root: Path) -> None:
    root = upstream_package(src, ["extern/hf"])
    sys.path.insert(0, str(root))
    tiny_timm()
    stub_modules("libero", "libero.libero", "libero.libero.benchmark", "libero.libero.envs")
    sys.modules["libero.libero"].get_libero_path = None
    sys.modules["libero.libero.envs"].OffScreenRenderEnv = None
    import prismatic.extern.hf.configuration_prismatic as configuration
    import prismatic.extern.hf.modeling_prismatic as modeling
    import prismatic.extern.hf.processing_prismatic as processing
    from experiments.robot import openvla_utils
    from experiments.robot.libero import libero_utils

    hf = types.SimpleNamespace(OpenVLAConfig=configuration.OpenVLAConfig,
                               OpenVLAForActionPrediction=modeling.OpenVLAForActionPrediction,
                               PrismaticImageProcessor=processing.PrismaticImageProcessor,
                               PrismaticProcessor=processing.PrismaticProcessor)
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
        results.update({f"{name}/{k}": v for k, v in openvla_case(model, processor, image, instruction).items()})
    np.savez_compressed(out_root / "openvla_tiny_outputs.npz", **results)
    print(f"openvla: {len(cases)} cases -> {out_root / 'openvla_tiny_outputs.npz'}")


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
def openvla_case(model, processor, image: np.ndarray, instruction: str) -> dict:
    """Upstream's ``get_vla_action`` for one frame (fp32), plus the teacher-forced logits."""
    from PIL import Image

    prompt = f"In: What action should the robot take to {instruction.lower()}?\nOut:"
    batch = processor(prompt, Image.fromarray(image).convert("RGB"))
    action = model.predict_action(**batch, unnorm_key=UNNORM_KEY, do_sample=False)
    ids = torch.cat([batch["input_ids"], torch.tensor([[29871]])], dim=1)
    generated = model.generate(ids, pixel_values=batch["pixel_values"], attention_mask=torch.ones_like(ids),
                               max_new_tokens=7, do_sample=False)[0, ids.shape[1]:]
    full = torch.cat([ids, generated[None, :-1]], dim=1)
    logits = model(input_ids=full, pixel_values=batch["pixel_values"], attention_mask=torch.ones_like(full)).logits
    return {"image": image, "instruction": np.array(instruction), "pixel_values": batch["pixel_values"][0].numpy(),
            "input_ids": batch["input_ids"][0].numpy(), "generated_ids": generated.numpy(),
            "logits": logits[0, -7:, LOGIT_IDS].numpy(), "action": np.asarray(action, dtype=np.float64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=["openvla", "oft"])
    parser.add_argument("--src", type=Path, required=True, help="the upstream repository's snapshot")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    {"openvla": build_openvla}[args.family](args.src, args.out)


if __name__ == "__main__":
    main()
