"""Upstream checkpoint options beyond the first three fixtures: each acts as upstream's code does.

Three more fixtures, built and run by the upstream code (benchmarks/reference/build_fixtures.py):

- ``openvla_single_tiny``: ``use_fused_vision_backbone: false`` (one SigLIP ViT, Prismatic's
  two-layer projector), ``image_resize_strategy: letterbox``, grouped-query attention, linear
  RoPE scaling, a vocabulary padded to a multiple of 32, 128 action bins, 3 layers; prompts of
  300 bytes and of non-ASCII text, which reach the prompt whole through the env's observation;
- ``openvla_oft_aloha_tiny``: OFT run with its ALOHA constants: min / max ("bounds")
  normalisation of actions and proprio, 25 x 14 action chunks, 14-dim proprio with a mask, three
  cameras, one layer with one key-value head;
- ``openvla_oft_proprio_mask_tiny``: OFT with LIBERO's q01 / q99 constants and proprio statistics
  whose mask leaves the gripper dimensions un-normalised; one camera, GQA, RoPE scaling.

Tolerances are the first fixtures': pixels 1e-6, logits and hidden states 1e-5 (fp32), tokens
identical, actions 1e-6 (token) / 1e-5 (L1 head).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reference import (  # noqa: F401  (inference, offline: autouse fixtures, active by being imported)
    ASSETS,
    inference,
    inputs,
    l1_oft_matches_upstream,
    load_policy,
    observation,
    offline,
    openvla_matches_upstream,
    outputs,
)

SINGLE_CASES = ["libero_eval", "maniskill", "gradient", "gradient_odd", "long_instruction", "non_ascii"]
SINGLE_LOGIT_IDS = slice(31616, 32032)  # 256 text ids, the 128 action ids, the 32 padding ids


# -- one vision backbone, letterbox, GQA, RoPE scaling, 128 bins -------------------------------------
@pytest.fixture(scope="module")
def single():
    policy = load_policy("openvla_7b_libero", "openvla_single_tiny", obs_spec={"rgb": ((224, 224, 3), np.uint8)},
                         unnorm_key="libero_10_no_noops")
    policy.adapter = type(policy.adapter)(gripper="libero")  # each case's frame is what upstream's processor saw
    return policy, outputs("openvla_single_tiny")


def test_single_backbone_checkpoint_loads_as_upstream_builds_it(single):
    """One ViT, no fused featurizer, the projector's two layers (fc1: vision -> llm), GQA, 128 bins."""
    policy, _ = single
    model = policy.model
    assert model.vision_backbone.fused_featurizer is None and model.projector.fc3 is None
    assert model.projector.fc1.weight.shape == (32, 40)
    attention = model.language_model.model.layers[0].self_attn
    assert attention.k_proj.weight.shape[0] == attention.q_proj.weight.shape[0] // 2  # 2 key-value heads of 4
    assert policy.actions.n_bins == 128 and policy.actions.action_ids[0] == 31999


@pytest.mark.parametrize("case", SINGLE_CASES)
def test_single_backbone_letterbox_checkpoint_acts_as_upstream_predict_action(single, case):
    policy, ref = single
    openvla_matches_upstream(policy, ref, case, SINGLE_LOGIT_IDS)


@pytest.mark.parametrize("case", ["long_instruction", "non_ascii"])
def test_long_and_non_ascii_instructions_reach_the_prompt_whole(single, case):
    """A 300-byte instruction and one with multi-byte characters, carried by the observation as an
    env encodes it, give upstream's prompt ids; nothing is cut (the field is as wide as needed)."""
    policy, ref = single
    instruction = str(ref[f"{case}/instruction"])
    obs = observation([ref[f"{case}/image"]], instruction)
    assert obs["instruction"].shape[1] >= len(instruction.encode())
    assert (len(instruction.encode()) == 300) if case == "long_instruction" else not instruction.isascii()
    ids, _ = policy._prompt_ids(obs)
    assert ids[0].tolist() == [*ref[f"{case}/input_ids"].tolist(), 29871]


def test_letterbox_pads_to_square_with_the_saved_fill_before_resizing(single):
    """The 180 x 240 frame gets 30 rows of the fill colour above and below (upstream's pad), so the
    top rows of the SigLIP input are the fill normalised: (127 / 255 - 0.5) / 0.5."""
    policy, ref = single
    pixels = policy._pixel_values(observation([ref["gradient/image"]], "x"), "cpu")[0]
    fill = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(pixels[:, :20], torch.full_like(pixels[:, :20], fill), atol=1e-6)
    assert not torch.allclose(pixels[:, 100:120], torch.full_like(pixels[:, 100:120], fill), atol=1e-2)


@pytest.mark.parametrize("case", ["maniskill", "gradient", "gradient_odd"])
def test_resize_crop_processor_gives_upstream_pixels(single, tmp_path, case):
    """Prismatic's third strategy, resize-crop (the shorter side to 224, then the centre crop), from the
    processor file upstream saved: the 180 x 240 frame is cut, not squashed or padded."""
    import shutil

    from policies.vla.processor import ImageProcessing

    policy, ref = single
    model = shutil.copytree(ASSETS / "openvla_single_tiny", tmp_path / "model")
    (model / "preprocessor_config.json").write_text(str(ref["resize_crop/preprocessor_config"]))
    images = ImageProcessing.from_pretrained(model, [224], backbones=1)
    assert images.strategy == "resize-crop" and images.transforms[0].size == 224
    pixels = images(torch.from_numpy(ref[f"{case}/image"])[None])[0]
    np.testing.assert_allclose(pixels.numpy(), ref[f"resize_crop/{case}/pixel_values"], rtol=0, atol=1e-6)


# -- OFT with ALOHA's constants: bounds normalisation, 25 x 14 chunks, 3 cameras ----------------------
ALOHA_CAMERAS = ("rgb", "left_wrist_rgb", "right_wrist_rgb")
ALOHA_FRAMES = {"aloha_libero_frames": ("libero_agentview", "libero_wrist", "maniskill_rgb"),
                "aloha_other_frames": ("gradient", "maniskill_rgb", "libero_wrist")}


@pytest.fixture(scope="module")
def aloha():
    spec = {camera: ((224, 224, 3), np.uint8) for camera in ALOHA_CAMERAS} | {"state": ((14,), np.float32)}
    policy = load_policy("openvla_oft_7b_aloha", "openvla_oft_aloha_tiny", obs_spec=spec, action_dim=14,
                         unnorm_key="aloha1_put_x_into_pot_300_demos")
    return policy, outputs("openvla_oft_aloha_tiny")


@pytest.mark.parametrize("case", list(ALOHA_FRAMES))
def test_oft_with_aloha_constants_acts_as_upstream_get_vla_action(aloha, case):
    """The config's adapter (JPEG + lanczos3 to 224, centre crop) on three cameras, proprio and actions
    normalised with min / max, one layer with one key-value head, the L1 head's 25 x 14 chunk."""
    policy, ref = aloha
    raw = [inputs()[key] for key in ALOHA_FRAMES[case]]
    frames = [policy.adapter.frames(torch.from_numpy(f)[None])[0].numpy() for f in raw]
    assert all(np.array_equal(a, b) for a, b in zip(frames, ref[f"{case}/images"], strict=True))
    obs = observation(frames, str(ref[f"{case}/instruction"]), ref[f"{case}/state"], cameras=ALOHA_CAMERAS)
    _, env_chunk = l1_oft_matches_upstream(policy, obs, ref, case)
    assert env_chunk.shape == (25, 14)
    np.testing.assert_allclose(env_chunk, ref[f"{case}/actions"], rtol=0, atol=1e-5)


def test_the_wrong_normalisation_is_a_different_policy(aloha):
    """What upstream's ALOHA constants guard against: the same checkpoint with q01 / q99 acts
    differently (the statistics must be read the way the checkpoint was trained)."""
    _, ref = aloha
    spec = {camera: ((224, 224, 3), np.uint8) for camera in ALOHA_CAMERAS} | {"state": ((14,), np.float32)}
    q99 = load_policy("openvla_oft_7b_aloha", "openvla_oft_aloha_tiny", "policy.vla.normalization=bounds_q99",
                      obs_spec=spec, action_dim=14, unnorm_key="aloha1_put_x_into_pot_300_demos")
    q99.adapter = type(q99.adapter)()
    case = "aloha_libero_frames"
    obs = observation(list(ref[f"{case}/images"]), str(ref[f"{case}/instruction"]), ref[f"{case}/state"],
                      cameras=ALOHA_CAMERAS)
    chunk, _, _ = q99.act(obs, deterministic=True)
    assert np.abs(q99.to_env(chunk)[0].numpy() - ref[f"{case}/actions"]).max() > 0.05


# -- OFT with a proprio mask (LIBERO's q01 / q99), one camera -------------------------------------------
@pytest.fixture(scope="module")
def proprio_mask():
    policy = load_policy("openvla_oft_7b_libero", "openvla_oft_proprio_mask_tiny", "policy.vla.cameras=[rgb]")
    return policy, outputs("openvla_oft_proprio_mask_tiny")


@pytest.mark.parametrize("case", ["libero_eval", "maniskill", "gradient"])
def test_oft_proprio_mask_leaves_masked_dims_as_upstream_normalize_proprio(proprio_mask, case):
    """Masked proprio dimensions un-normalised (then clipped), the rest by q01 / q99; one camera."""
    policy, ref = proprio_mask
    obs = observation([ref[f"{case}/images"][0]], str(ref[f"{case}/instruction"]), ref[f"{case}/state"])
    chunk, _ = l1_oft_matches_upstream(policy, obs, ref, case)
    proprio = policy._proprio(obs["state"].double())[0].numpy()
    state = ref[f"{case}/state"]
    masked = ~policy.proprio_stats.normalize_mask.numpy()
    assert masked.sum() == 2 and np.allclose(proprio[masked], np.clip(state[masked], -1, 1), atol=1e-6)
    np.testing.assert_allclose(policy.actions.unnormalize(chunk.unflatten(-1, (8, 7)))[0].numpy(),
                               ref[f"{case}/actions"], rtol=0, atol=1e-5)


# -- weights that do not fit config.json: the report names them ----------------------------------------
def test_weights_of_another_size_are_named_not_blamed_on_an_incomplete_copy(tmp_path):
    """A complete directory whose config.json says another MLP width: the error lists the weights that
    do not fit, with both shapes (transformers' own report stays hidden behind its quiet loading)."""
    import json
    import shutil

    from envs.common import UserError

    model = shutil.copytree(ASSETS / "openvla_tiny", tmp_path / "openvla_tiny")
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 48
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        load_policy("openvla_7b_libero", str(model))
    message = str(err.value)
    assert "6 weights of other shapes" in message and "(32, 16) in the weights, (48, 16) per config.json" in message
    assert "complete copy" not in message
