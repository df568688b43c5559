"""The OpenVLA-OFT fixtures (``oft``, ``oft_aloha``, ``oft_proprio_mask``) and SimpleVLA-RL's batched rollout
(``simplevla``), built with upstream code by build_fixtures.py (see its docstring)."""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from upstream_common import (  # noqa: E402
    LOGIT_IDS,
    STEP,
    TEXT_CONFIG,
    UNNORM_KEY,
    Shape,
    libero_env_action,
    load_inputs,
    load_upstream,
    save_checkpoint,
    stub_modules,
    tiny_timm,
    upstream_package,
)

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
