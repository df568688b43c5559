"""The Qwen2.5-VL VLA against transformers' own Qwen2.5-VL (tiny model, CPU, fp32).

1. ``act()``'s KV-cached decoding (the prompt in one padded batch, then one action token at a time
   with 3-D rope positions built by the policy) scores every action token as transformers'
   ``Qwen2_5_VLForConditionalGeneration.forward`` does over the whole unpadded sequence, with the
   rope positions transformers computes itself (``get_rope_index``).
2. The images the model sees are what transformers' Qwen2.5-VL image processor
   (``Qwen2VLImageProcessorPil``) makes of them, with the settings of the checkpoint's
   preprocessor_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2VLImageProcessorPil

from embodied.config import compose
from envs.base import encode_instructions
from policies.registry import make_policy
from policies.vla.qwen_vl import QWEN_PROMPT, VISION_TOKENS, QwenVLPolicy

INPUTS = Path(__file__).resolve().parents[1] / "assets" / "reference" / "inputs.npz"
ACTION_DIM, CHUNK = 4, 3  # T = 12 action tokens per decision
FRAME = (96, 160)  # non-square: with image_size 112 -> 84 x 140 px, a 3 x 5 grid of 15 image tokens
# different lengths: the batch's prompts are left-padded by different amounts
INSTRUCTIONS = ["push the cube", "open the top drawer of the cabinet",
                "pick up the black bowl between the plate and the ramekin and place it on the plate"]
ATOL = 1e-5


def _policy(*overrides: str, frame: tuple[int, int] = FRAME) -> QwenVLPolicy:
    cfg = compose(["policy=qwen_vl_tiny", f"policy.chunk_size={CHUNK}", *overrides]).policy
    torch.manual_seed(0)
    return make_policy(cfg, {"rgb": ((*frame, 3), torch.uint8)}, ACTION_DIM).eval()


@pytest.fixture(scope="module")
def policy() -> QwenVLPolicy:
    return _policy("policy.vla.image_size=112")


def _frames() -> np.ndarray:
    """Three different real frames (LIBERO agent view and wrist, a gradient), cropped: uint8 ``[3, *FRAME, 3]``."""
    inputs = np.load(INPUTS)
    h, w = FRAME
    crops = [inputs["libero_agentview"][60:60 + h, 40:40 + w], inputs["libero_wrist"][80:80 + h, 60:60 + w],
             inputs["gradient"][40:40 + h, 50:50 + w]]
    return np.stack(crops)


def _obs() -> dict[str, torch.Tensor]:
    """``rgb`` uint8 ``[3, *FRAME, 3]``, ``instruction`` uint8 ``[3, 128]``."""
    return {"rgb": torch.from_numpy(_frames()),
            "instruction": torch.from_numpy(encode_instructions(INSTRUCTIONS))}


def _spy(method: Callable, record: list[torch.Tensor], take: Callable) -> Callable:
    def spied(*args, **kwargs):
        out = method(*args, **kwargs)
        record.append(take(out).detach().clone())
        return out

    return spied


def _cached_decode(policy: QwenVLPolicy, obs: dict[str, torch.Tensor], noise: torch.Tensor | None,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``act()`` (greedy without ``noise``) -> ``(bins [B, T], token log-probs [B, T], logits
    [B, T, V])``: the logits each action token was sampled from (the prompt's last, then ``_step``'s)."""
    record: list[torch.Tensor] = []
    monkeypatch.setattr(policy, "_run", _spy(policy._run, record, lambda out: out[0][:, -1]))
    monkeypatch.setattr(policy, "_step", _spy(policy._step, record, lambda out: out[0]))
    bins, logprobs, _ = policy.act(obs, deterministic=noise is None, noise=noise)
    monkeypatch.undo()
    return bins, logprobs, torch.stack(record, dim=1)


def _prompt_ids(policy: QwenVLPolicy, instruction: str, grid: torch.Tensor) -> list[int]:
    """``[BOS] + <|vision_start|><|image_pad|> x N<|vision_end|> + prompt``: N the ``grid`` ``[1, 3]``
    of patches merged 2 x 2."""
    start, pad, end = VISION_TOKENS
    tokens = int(grid.prod()) // policy.model.config.vision_config.spatial_merge_size ** 2
    text = start + pad * tokens + end + QWEN_PROMPT.format(instruction=instruction)
    return [policy.tokenizer.bos_token_id, *policy.tokenizer.encode(text, add_special_tokens=False)]


@torch.no_grad()
def _full_forward_logits(policy: QwenVLPolicy, frame: np.ndarray, instruction: str,
                         action_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """transformers' forward over one unpadded row, prompt + all ``action_ids [T]``, no positions
    given -> ``(the logits that predict each action token [T, V], rope delta of the row)``."""
    vision = policy.images(images=[frame], return_tensors="pt")
    prompt = _prompt_ids(policy, instruction, vision["image_grid_thw"])
    ids = torch.tensor([prompt + action_ids.tolist()])
    out = policy.model(input_ids=ids, pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"],
                       mm_token_type_ids=(ids == policy.model.config.image_token_id).int())
    return out.logits[0, len(prompt) - 1:-1], int(policy.model.model.rope_deltas)


@pytest.mark.parametrize("decoding", ["greedy", "sampled"])
def test_qwen_vl_cached_decode_equals_transformers_full_forward(policy, decoding, monkeypatch):
    obs = _obs()
    noise = torch.randn(3, CHUNK * ACTION_DIM, generator=torch.Generator().manual_seed(1)) if decoding == "sampled" \
        else None
    bins, logprobs, cached = _cached_decode(policy, obs, noise, monkeypatch)
    action_ids = policy.actions.action_ids[bins.long()]  # [B, T]
    lengths = set()
    for row, (frame, instruction) in enumerate(zip(_frames(), INSTRUCTIONS, strict=True)):
        full, rope_delta = _full_forward_logits(policy, frame, instruction, action_ids[row])
        assert rope_delta == 5 - 15  # the 3 x 5 token image takes 5 positions: the rope offset matters
        lengths.add(len(_prompt_ids(policy, instruction, policy.images(images=[frame])["image_grid_thw"])))
        torch.testing.assert_close(cached[row], full, atol=ATOL, rtol=0)
        full_logp = policy._bin_logprobs(full)  # [T, n_bins]
        torch.testing.assert_close(logprobs[row], full_logp.gather(-1, bins[row].long()[:, None])[:, 0],
                                   atol=ATOL, rtol=0)
        if decoding == "greedy":
            assert torch.equal(bins[row].long(), full_logp.argmax(-1))
    assert len(lengths) == 3  # each row padded differently


def _model_inputs(policy: QwenVLPolicy, rgb: np.ndarray) -> dict[str, torch.Tensor]:
    """What ``_run`` feeds the model for uint8 frames ``rgb [B, H, W, 3]``: ``pixel_values [P, 3 * 2 *
    14 * 14]`` (P patches of all images) and ``image_grid_thw [B, 3]``."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, _args, kwargs):
        seen.update({k: kwargs[k].detach().clone() for k in ("pixel_values", "image_grid_thw")})

    handle = policy.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        policy.value({"rgb": torch.from_numpy(rgb)})
    finally:
        handle.remove()
    return seen


def _assert_inputs_equal(ours: dict[str, torch.Tensor], reference: Qwen2VLImageProcessorPil, rgb: np.ndarray) -> None:
    expected = reference(images=list(rgb), return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(ours["pixel_values"], expected["pixel_values"], atol=1e-6, rtol=0)


def _real_frames() -> dict[str, np.ndarray]:
    """Batches of two uint8 frames ``[2, H, W, 3]``: square noise, non-square noise, real LIBERO /
    ManiSkill / gradient frames."""
    g = np.random.default_rng(0)
    inputs = np.load(INPUTS)
    return {"noise_128": g.integers(0, 256, (2, 128, 128, 3), dtype=np.uint8),
            "noise_96x160": g.integers(0, 256, (2, 96, 160, 3), dtype=np.uint8),
            "libero_256": np.stack([inputs["libero_agentview"], inputs["libero_wrist"]]),
            "maniskill_128": np.stack([inputs["maniskill_rgb"], inputs["maniskill_rgb"][::-1]]),
            "gradient_180x240": np.stack([inputs["gradient"], inputs["gradient"][:, ::-1]])}


@pytest.mark.parametrize("name", list(_real_frames()))
def test_qwen_vl_images_equal_transformers_qwen2_vl_image_processor(name):
    """A model built here: transformers' Qwen2.5-VL processing, pixels within [56 x 56, image_size ** 2]."""
    rgb = _real_frames()[name]
    policy = _policy(frame=rgb.shape[1:3])
    reference = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=64 ** 2)  # qwen_vl_tiny: image_size 64
    _assert_inputs_equal(_model_inputs(policy, rgb), reference, rgb)


# non-default where the model allows (patch, merge and temporal patch sizes are the vision tower's)
CHECKPOINT_PROCESSOR = {"min_pixels": 28 * 28 * 12, "max_pixels": 28 * 28 * 20, "patch_size": 14,
                        "temporal_patch_size": 2, "merge_size": 2, "resample": 2,
                        "image_mean": [0.3, 0.5, 0.7], "image_std": [0.2, 0.25, 0.3],
                        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A saved tiny Qwen-VL VLA whose preprocessor_config.json is in upstream's format (as
    Qwen/Qwen2.5-VL-3B-Instruct ships it) with non-default settings."""
    path = tmp_path_factory.mktemp("qwen_vl_checkpoint")
    _policy().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(CHECKPOINT_PROCESSOR))
    return path


@pytest.mark.parametrize("image_size", [224, 112])
def test_qwen_vl_image_processing_follows_the_checkpoints_preprocessor_config(checkpoint, image_size):
    """policy.vla.model_path's min / max pixels, resample, mean / std are used; ``policy.vla.image_size ** 2``
    only caps the pixel count further (224 ** 2: the checkpoint's max binds; 112 ** 2: the cap)."""
    rgb = _real_frames()["gradient_180x240"]
    policy = _policy(f"policy.vla.model_path={checkpoint}", f"policy.vla.image_size={image_size}", frame=rgb.shape[1:3])
    settings = {k: v for k, v in CHECKPOINT_PROCESSOR.items()
                if not k.endswith("_class") and k != "image_processor_type"}
    settings["max_pixels"] = min(settings["max_pixels"], image_size ** 2)
    ours = _model_inputs(policy, rgb)
    _assert_inputs_equal(ours, Qwen2VLImageProcessorPil(**settings), rgb)
    default = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=image_size ** 2)(images=list(rgb),
                                                                                       return_tensors="pt")
    assert not torch.equal(ours["image_grid_thw"], default["image_grid_thw"]) or not torch.allclose(
        ours["pixel_values"], default["pixel_values"])  # the checkpoint's settings made a difference
    small = np.ascontiguousarray(rgb[:, :56, :56])  # 56 x 56 px: below min_pixels, so enlarged
    _assert_inputs_equal(_model_inputs(policy, small), Qwen2VLImageProcessorPil(**settings), small)
