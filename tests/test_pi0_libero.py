"""pi0 / pi0.5 as their LIBERO references run them (configs/policy/pi0*_3b_libero_*.yaml,
docs/design/pi0_libero.md): openpi's checkpoint layout and statistics, openpi's image resize, openpi's
delta actions, lerobot's bfloat16, and the configs that put them together."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from embodied.config import compose
from envs.common import UserError
from policies.flow_steps import accumulated_time_grid, time_grid
from policies.pi0.inputs import pil_resize_with_pad, resize_with_pad
from policies.registry import check_policy_config
from policies.vla.processor import byte_tokenizer
from tests.reference import ASSETS
from tests.test_pi0_policy import _fixture_policy

LIBERO_CONFIGS = ("pi05_3b_libero_lerobot", "pi05_3b_libero_openpi", "pi0_3b_libero_openpi")
RL_CONFIGS = ("pi0_3b_libero_rl", "pi0_3b_libero_lora", "pi05_3b_libero_rl", "pi05_3b_libero_lora")


def _as_openpi(tmp_path, name: str, stats_dir: str = "assets/physical-intelligence/libero"):
    """The lerobot fixture rewritten in openpi's layout, as its converter writes it: names without ``model.``,
    the token embedding tied into ``lm_head``, config.json's five keys, norm_stats.json from the same statistics."""
    src, out = ASSETS / name, tmp_path / name
    out.mkdir()
    tensors = {k.removeprefix("model."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    embed = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    tensors["paligemma_with_expert.paligemma.lm_head.weight"] = tensors.pop(embed)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": config["chunk_size"],
                                                 "paligemma_variant": "gemma_2b", "action_expert_variant":
                                                 "gemma_300m", "precision": "float32"}))
    pre = load_file(str(next(src.glob("policy_preprocessor_step_*_normalizer_processor.safetensors"))))
    post = load_file(str(src / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    stats = {key: {s: t[f"{feature}.{s}"].tolist() for s in ("mean", "std", "q01", "q99")}
             for key, feature, t in (("state", "observation.state", pre), ("actions", "action", post))}
    (out / stats_dir).mkdir(parents=True)
    (out / stats_dir / "norm_stats.json").write_text(json.dumps({"norm_stats": stats}))
    return out


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_an_openpi_checkpoint_acts_as_the_same_network_in_lerobots_layout(name, tmp_path, monkeypatch):
    """Same weights and statistics in openpi's layout: pi0 / pi0.5 told from the tensors, a third camera slot
    blank and masked, the statistics applied with openpi's eps (1e-6: the actions move by ~1e-6 relative)."""
    lerobot, obs, ref, _ = _fixture_policy(name, monkeypatch)
    openpi_dir = _as_openpi(tmp_path, name)
    openpi, _, _, _ = _fixture_policy(name, monkeypatch, **{"policy.vla.model_path": openpi_dir})
    assert openpi.size == lerobot.size and openpi.empty_cameras == 1 and lerobot.empty_cameras == 0
    assert openpi.action_norm.convention == "openpi" and openpi.action_norm.eps == 1e-6
    assert openpi.action_norm.mode == ("quantiles" if name == "pi05_tiny" else "mean_std")
    # evaluated at the times openpi's sampler visits (tests/test_pi0_parity.py: openpi's own model)
    assert torch.equal(openpi.ode_times(10), accumulated_time_grid(10)) and torch.equal(lerobot.ode_times(10),
                                                                                       time_grid(10))
    noise = torch.zeros(len(ref["state"]), lerobot.noise_dim)
    noise[:, :lerobot.width] = torch.from_numpy(ref["noise"]).flatten(1)
    with torch.no_grad():
        ours = openpi.to_env(openpi.act(obs, deterministic=True, noise=noise)[0])
    torch.testing.assert_close(ours, torch.from_numpy(ref["actions"][:, :5]), rtol=1e-4, atol=1e-4)
    assert not torch.equal(ours, torch.from_numpy(ref["actions"][:, :5]))  # openpi's eps, not lerobot's


@pytest.mark.parametrize("breakage, words", [
    (lambda d: shutil.rmtree(d / "assets"), ["holds none", "policy.pi.norm_stats"]),
    (lambda d: shutil.copytree(d / "assets", d / "physical-intelligence"), ["holds 2"]),
])
def test_an_openpi_checkpoint_without_one_statistics_file_is_refused(tmp_path, breakage, words):
    ckpt = _as_openpi(tmp_path, "pi0_tiny")
    breakage(ckpt)
    cfg = compose(_overrides(ckpt))
    with pytest.raises(UserError) as err:
        check_policy_config(cfg.policy, 7)
    assert all(w in str(err.value) for w in words), str(err.value)
    stats = next((tmp_path / "pi0_tiny").rglob("norm_stats.json"), None)
    if stats is not None:  # several: the one named is used
        byte_tokenizer(0).save_pretrained(tmp_path / "tokenizer")
        check_policy_config(compose([*_overrides(ckpt), f"policy.pi.norm_stats={stats}",
                                     f"policy.pi.tokenizer_path={tmp_path / 'tokenizer'}"]).policy, 7)


def _overrides(ckpt) -> list[str]:
    return ["policy=pi0_tiny", f"policy.vla.model_path={ckpt}", "policy.vla.cameras=[rgb,wrist_rgb]",
            "policy.pi.vision_head_dim=16"]


def test_delta_actions_add_the_planning_state_to_the_leading_dims(monkeypatch):
    """openpi's pi0_libero: ``a[:6] += state[:6]``, the state the chunk was planned on, the gripper absolute; a
    demo's absolute actions become the offsets the model is trained on."""
    policy, obs, ref, _ = _fixture_policy("pi0_tiny", monkeypatch, **{"policy.pi.delta_actions": 6})
    with torch.no_grad():
        actions = policy.act(obs, deterministic=True)[0]
        absolute = policy.to_env(actions, obs)
        policy.delta_actions = 0
        offsets = policy.to_env(actions, obs)
    state = obs["state"][:, None, :]
    torch.testing.assert_close(absolute[..., :6], offsets[..., :6] + state[..., :6])
    torch.testing.assert_close(absolute[..., 6:], offsets[..., 6:])
    policy.delta_actions = 6
    with pytest.raises(ValueError, match="observations"):
        policy.to_env(actions)
    with pytest.raises(UserError, match="delta_actions=9"):
        check_policy_config(compose(["policy=pi0_tiny", "policy.pi.delta_actions=9"]).policy, 7)


def test_openpis_resize_is_pils_antialiased_bilinear():
    """256 -> 224 on uint8 as openpi's client does it (PIL), which is not lerobot's float bilinear."""
    frames = torch.randint(0, 256, (2, 256, 192, 3), dtype=torch.uint8)
    ours = pil_resize_with_pad(frames, 224)
    pil = np.asarray(Image.fromarray(frames[1].numpy()).resize((168, 224), resample=Image.BILINEAR))
    assert ours.dtype == torch.uint8 and ours.shape == (2, 224, 224, 3)
    np.testing.assert_array_equal(ours[1, :, 28:196].numpy(), pil)
    assert ours[:, :, :28].eq(0).all() and ours[:, :, 196:].eq(0).all()  # black bars left and right
    torch_resized = resize_with_pad(frames.permute(0, 3, 1, 2).float() / 255, 224)
    assert (torch_resized.permute(0, 2, 3, 1) * 255 - ours.float()).abs().max() > 2
    assert pil_resize_with_pad(ours, 224) is ours  # already the vision size


# Our bfloat16 run against lerobot's, made on another CPU: each is its own bf16 rounding error away from the exact
# result (float32 is 2^16 times nearer), and lerobot's is in the fixtures: its bf16 actions against its float32 ones,
# same inputs and noise (0.0083 here, after the SigLIP -> bf16 cast, 2 + 2 Gemma layers and 10 Euler steps). Ours is
# the same computation's, of the same size on any CPU (0.0050 to 0.0084 under ATEN_CPU_CAPABILITY default / avx2 /
# avx512). So the two runs may differ by both errors, plus the float32 parity (1e-5, test_pi0_policy.py). The runs
# differed by 0.0047 at most; a time off by 0.01, a skipped layer or a norm eps of 1e-2 moves the actions by 0.07-0.8.
BF16_RUNS = 2  # ours and lerobot's, each up to lerobot's own bf16 error from the exact result


def test_bfloat16_policy_acts_near_lerobots_bfloat16_run(monkeypatch):
    policy, obs, ref, _ = _fixture_policy("pi05_tiny", monkeypatch, **{"policy.vla.dtype": "bfloat16"})
    bf16 = dict(np.load(ASSETS / "pi05_tiny_bf16_outputs.npz"))
    assert policy.model.expert.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    noise = torch.zeros(len(ref["state"]), policy.noise_dim)
    noise[:, :policy.width] = torch.from_numpy(ref["noise"]).flatten(1)
    with torch.no_grad():
        actions, _, value = policy.act(obs, deterministic=True, noise=noise)
    assert value.dtype == torch.float32
    lerobots_error = np.abs(bf16["actions"][:, :5] - ref["actions"][:, :5]).max()
    torch.testing.assert_close(policy.to_env(actions), torch.from_numpy(bf16["actions"][:, :5]), rtol=1e-5,
                               atol=BF16_RUNS * lerobots_error + 1e-5)
    with pytest.raises(UserError, match="float32 or bfloat16"):
        check_policy_config(compose(["policy=pi0_tiny", "policy.vla.dtype=float16"]).policy, 8)


def test_lerobots_relative_actions_are_refused(tmp_path):
    ckpt = tmp_path / "pi0_tiny"
    shutil.copytree(ASSETS / "pi0_tiny", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "use_relative_actions": True}))
    with pytest.raises(UserError, match="use_relative_actions"):
        check_policy_config(compose(_overrides(ckpt)).policy, 7)


@pytest.mark.parametrize("name", LIBERO_CONFIGS + RL_CONFIGS)
def test_a_libero_reference_config_refuses_other_images_and_names_its_checkpoint(name):
    """Each config sets the env as its reference renders (and evaluates: resets) it, and names the missing
    checkpoint; the RL configs train on soft resets what their evaluation config evaluates."""
    from embodied.checks import _check_camera_is_the_trained_one as check_camera_images

    cfg = compose(["env=libero_spatial", f"policy={name}"])
    check_camera_images(cfg)
    with pytest.raises(UserError, match="env.image_size"):
        check_camera_images(compose(["env=libero_spatial", f"policy={name}", "env.image_size=128"]))
    assert cfg.policy.vla.dtype == "bfloat16"
    assert cfg.env.protocol == "default" if name in RL_CONFIGS else cfg.env.protocol in ("lerobot", "openpi")
    with pytest.raises(UserError, match="no config.json there"):
        check_policy_config(cfg.policy, 7)
