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
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from oft_fixtures import build_oft, build_oft_aloha, build_oft_proprio_mask, build_simplevla  # noqa: E402
from upstream_common import (  # noqa: E402
    PROCESSOR_AUTO_MAP,
    Shape,
    eval_image,
    import_openvla,
    libero_env_action,
    load_inputs,
    load_upstream,
    save_checkpoint,
)


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
