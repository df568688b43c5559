"""``policy=pi0`` (policies/pi0/policy.py): a lerobot checkpoint acting through the Policy protocol as
lerobot does on the same observation and noise; the chain RL samples and re-scores; bad checkpoints
refused before any worker starts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import policies.pi0.policy as pi0_policy
from embodied.algorithms.logprob_levels import group_logprobs
from embodied.config import compose
from envs.base import encode_instructions
from envs.common import UserError
from policies.registry import check_policy_config, make_policy
from tests.reference import ASSETS


class FixtureTokenizer:
    """The fixture's token ids for its prompts: lerobot's run used ids, not PaliGemma's tokenizer
    (which is not downloadable here), so this stands in for the tokenizer and nothing else."""

    bos_token_id = 2

    def __init__(self, ref):
        self.ids = {str(p): [int(i) for i, m in zip(row[1:], mask[1:], strict=True) if m]
                    for p, row, mask in zip(ref["prompts"], ref["tokens"], ref["token_mask"], strict=True)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.ids[text]


def _fixture_policy(name: str, monkeypatch, **overrides):
    ref = dict(np.load(ASSETS / f"{name}_outputs.npz"))
    monkeypatch.setattr(pi0_policy, "_tokenizer", lambda *args, **kwargs: FixtureTokenizer(ref))
    cameras = ["rgb", "wrist_rgb"][:ref["frames_u8"].shape[0]]
    cfg = compose(["policy=pi0_tiny", f"policy.vla.model_path={ASSETS / name}",
                   f"policy.vla.cameras=[{','.join(cameras)}]", "policy.pi.vision_head_dim=16",
                   "policy.flow.eval_steps=10", "policy.chunk_size=5",
                   *[f"{k}={v}" for k, v in overrides.items()]])
    obs = {cam: torch.from_numpy(ref["frames_u8"][i]) for i, cam in enumerate(cameras)}
    obs["state"] = torch.from_numpy(ref["state"])
    obs["instruction"] = torch.from_numpy(encode_instructions([str(t) for t in ref["tasks"]]))
    spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()}
    return make_policy(cfg.policy, spec, 7).eval(), obs, ref, cfg


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_a_lerobot_checkpoint_acts_as_lerobot_does(name, monkeypatch):
    """Raw camera frames, state and instruction in; the first chunk_size of lerobot's un-normalised
    actions out, from the same noise through the checkpoint's 10 Euler steps."""
    policy, obs, ref, _ = _fixture_policy(name, monkeypatch)
    noise = torch.zeros(len(ref["state"]), policy.noise_dim)
    noise[:, :policy.width] = torch.from_numpy(ref["noise"]).flatten(1)
    with torch.no_grad():
        actions, _, _ = policy.act(obs, deterministic=True, noise=noise)
    torch.testing.assert_close(policy.to_env(actions), torch.from_numpy(ref["actions"][:, :5]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["sde", "noise"])
def test_rl_rescores_the_sampled_chain_to_the_same_log_probs(method, monkeypatch):
    policy, obs, _, _ = _fixture_policy("pi0_tiny", monkeypatch, **{"policy.flow.method": method})
    torch.manual_seed(0)
    actions, logprob, value = policy.act(obs)
    again, entropy, value_again = policy.evaluate(obs, actions)
    torch.testing.assert_close(again, logprob)
    torch.testing.assert_close(value_again, value)
    # the executed actions (chunk_size of the model's 50) in the env's 7 dims (of 32): one unit per action
    assert logprob.shape == (2, 5 * 7) and entropy.shape == (2,)
    assert group_logprobs(logprob, "action", 7).shape == (2, 5)
    again.sum().backward()  # gradients reach the expert through the re-scored chain
    assert policy.model.action_in_proj.weight.grad is not None


def test_expert_only_training_freezes_the_vlm(monkeypatch):
    policy, obs, _, _ = _fixture_policy("pi0_tiny", monkeypatch, **{"policy.flow.train": "expert"})
    assert not any(p.requires_grad for p in policy.model.vlm.parameters())
    assert all(p.requires_grad for p in policy.model.expert.parameters())
    policy.demo_loss(obs, torch.rand(2, 5, 7))["loss"].backward()
    assert policy.model.action_out_proj.weight.grad is not None


@pytest.mark.parametrize("variant", ["pi0_tiny", "pi05_tiny"])
def test_a_tiny_network_from_scratch_acts_and_learns_from_demos(variant):
    cfg = compose([f"policy={variant}"])
    obs = {"rgb": torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8), "state": torch.randn(3, 9)}
    policy = make_policy(cfg.policy, {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()}, 8)
    actions, _, _ = policy.act(obs, deterministic=True)
    assert policy.to_env(actions).shape == (3, 4, 8)
    loss = policy.demo_loss(obs, torch.rand(3, 4, 8))["loss"]
    loss.backward()
    assert torch.isfinite(loss) and policy.model.paligemma_with_expert.paligemma.model.vision_tower \
        .embeddings.patch_embedding.weight.grad is not None


def _copy(tmp_path, name="pi0_tiny"):
    target = tmp_path / name
    shutil.copytree(ASSETS / name, target)
    return target


def _edit_json(name: str, **changes):
    """A breakage: ``changes`` written into the checkpoint's ``name`` (``vision_config={...}`` merges)."""
    def edit(d):
        data = json.loads((d / name).read_text())
        for key, value in changes.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        (d / name).write_text(json.dumps(data))
    return edit


def _edit_tensors(change):
    """A breakage: ``change(tensors)`` applied to model.safetensors (lerobot's names)."""
    def edit(d):
        from safetensors.torch import load_file, save_file

        tensors = load_file(d / "model.safetensors")
        change(tensors)
        save_file(tensors, d / "model.safetensors")
    return edit


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-4096])


EXPERT_MLP = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp."


@pytest.mark.parametrize("breakage, words", [
    (_edit_tensors(lambda t: t.pop(EXPERT_MLP + "down_proj.weight")),
     ["does not hold the network", "1 weight(s) the network has are missing", "gemma_expert.model.layers.1.mlp.down"]),
    (_edit_tensors(lambda t: t.update({"model.value_head.weight": torch.zeros(3, 4)})),
     ["1 weight(s) in it are not the network's (value_head.weight)"]),
    (_edit_tensors(lambda t: t.update({EXPERT_MLP + "up_proj.weight": torch.zeros(48, 32)})),
     ["1 weight(s) have other shapes", "up_proj.weight: (48, 32) in the file, (64, 32) per the config"]),
    (_truncate, ["model.safetensors is", "truncated", "Download it again"]),
    (_edit_json("config.json", dtype="float16"), ["dtype='float16'", "bfloat16"]),
    (_edit_json("config.json", image_resolution=[100, 100]), ["image_resolution 100", "positions"]),
    (_edit_json("tiny_overrides.json", vision_config={"num_attention_heads": 5}), ["5 heads do not divide"]),
    (lambda d: (d / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink(),
     ["unnormalizer_processor.safetensors is missing", "Download it"]),
    (lambda d: (d / "model.safetensors").unlink(), ["no model.safetensors"]),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "type": "act"})), ["not a pi0 or pi0.5 checkpoint"]),
])
def test_a_broken_checkpoint_is_refused_before_workers_start(tmp_path, breakage, words):
    """What lerobot would refuse at build time (or could not load) is refused by the driver's check: the network
    built on the meta device against the safetensors header, the config's fields, the files it names."""
    ckpt = _copy(tmp_path)
    breakage(ckpt)
    with pytest.raises(UserError) as err:
        check_policy_config(compose(["policy=pi0_tiny", f"policy.path={ckpt}", "policy.vla.cameras=[rgb,wrist_rgb]"]
                                    ).policy, 7)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_an_empty_camera_slot_is_fed_blank_and_masked_out(tmp_path, monkeypatch):
    """A checkpoint with ``empty_cameras`` (lerobot's LIBERO pi0.5) lists a blank camera the env does not
    give: fed as -1 and masked, it changes no action (lerobot's actions without the slot)."""
    ckpt = _copy(tmp_path, "pi05_tiny_1cam")
    config = json.loads((ckpt / "config.json").read_text())
    config["input_features"]["observation.images.empty_camera_0"] = {"type": "VISUAL", "shape": [3, 224, 224]}
    (ckpt / "config.json").write_text(json.dumps(config))
    ref = dict(np.load(ASSETS / "pi05_tiny_1cam_outputs.npz"))
    monkeypatch.setattr(pi0_policy, "_tokenizer", lambda *args, **kwargs: FixtureTokenizer(ref))
    cfg = compose(["policy=pi0_tiny", f"policy.vla.model_path={ckpt}", "policy.pi.vision_head_dim=8",
                   "policy.flow.eval_steps=10"])
    obs = {"rgb": torch.from_numpy(ref["frames_u8"][0]), "state": torch.from_numpy(ref["state"]),
           "instruction": torch.from_numpy(encode_instructions([str(t) for t in ref["tasks"]]))}
    policy = make_policy(cfg.policy, {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()}, 7).eval()
    assert policy.empty_cameras == 1
    noise = torch.zeros(1, policy.noise_dim)
    noise[:, :policy.width] = torch.from_numpy(ref["noise"]).flatten(1)
    with torch.no_grad():
        actions = policy.to_env(policy.act(obs, deterministic=True, noise=noise)[0])
    assert cfg.policy.chunk_size == config["n_action_steps"] == 10  # the checkpoint's, as lerobot executes it
    torch.testing.assert_close(actions, torch.from_numpy(ref["actions"][:, :10]), rtol=1e-5, atol=1e-5)


def test_mirrored_cameras_are_the_frames_flipped_left_right(monkeypatch):
    policy, obs, _, _ = _fixture_policy("pi0_tiny", monkeypatch, **{"policy.vla.mirror_images": "true"})
    flipped = {k: (v.flip(2) if k in ("rgb", "wrist_rgb") else v) for k, v in obs.items()}
    with torch.no_grad():
        mirrored = policy.heads(obs)[0].prefix.hidden
        policy.mirror = False
        torch.testing.assert_close(policy.heads(flipped)[0].prefix.hidden, mirrored, rtol=0, atol=0)
        assert not torch.equal(policy.heads(obs)[0].prefix.hidden, mirrored)


def test_other_families_settings_are_refused():
    with pytest.raises(UserError, match="does not read policy.vla.gripper=libero"):
        check_policy_config(compose(["policy=pi0_tiny", "policy.vla.gripper=libero"]).policy, 8)


def test_a_checkpoint_of_another_robot_is_refused(tmp_path):
    with pytest.raises(UserError, match="vision_head_dim=72 do not divide"):
        check_policy_config(compose(["policy=pi0_tiny", f"policy.vla.model_path={ASSETS / 'pi0_tiny'}",
                                     "policy.vla.cameras=[rgb,wrist_rgb]", "policy.pi.vision_head_dim=72"]).policy, 7)
    cfg = compose(["policy=pi0_tiny", f"policy.path={ASSETS / 'pi0_tiny'}", "policy.vla.cameras=[rgb,wrist_rgb]"])
    with pytest.raises(UserError, match="acts in 7 dimensions"):
        check_policy_config(cfg.policy, 8)
    with pytest.raises(UserError, match="reads 2 camera"):
        check_policy_config(compose(["policy=pi0_tiny", f"policy.vla.model_path={ASSETS / 'pi0_tiny'}",
                                     "policy.pi.vision_head_dim=16"]).policy, 7)
    spec = {"rgb": ((64, 64, 3), torch.uint8), "wrist_rgb": ((64, 64, 3), torch.uint8), "state": ((9,), torch.float32)}
    with pytest.raises(UserError, match="reads a state of 8 numbers, but this env.s has 9"):
        pi0_policy.PiPolicy.check_observations(cfg.policy, spec, 7)
    with pytest.raises(UserError, match="does not observe"):
        pi0_policy.PiPolicy.check_observations(cfg.policy, {"rgb": spec["rgb"], "state": spec["state"]}, 7)
    with pytest.raises(UserError, match="holds no tokenizer .* Put the tokenizer's files .* in the checkpoint"):
        check_policy_config(cfg.policy, 7)  # the shipped fixtures hold none, and no PaliGemma is cached here
    with pytest.raises(UserError, match="holds no tokenizer"):
        make_policy(cfg.policy, {"rgb": ((64, 64, 3), torch.uint8), "wrist_rgb": ((64, 64, 3), torch.uint8),
                                 "state": ((8,), torch.float32)}, 7)


@pytest.mark.slow  # 35-70 s of LIBERO start-up; the CLI's LIBERO table and videos: test_eval_protocol.py, default
def test_a_lerobot_pi05_checkpoint_is_evaluated_on_libero_from_the_cli(ray_cluster, tmp_path):
    """``embodied eval env=libero_spatial policy=pi05_tiny`` with the shipped lerobot-layout fixture (7-D
    actions, 8-D state, agentview + wrist mirrored as LIBERO checkpoints see them) and a local tokenizer:
    the per-task table, eval.json and a video per task."""
    from embodied.cli import main as cli_main
    from policies.vla.processor import byte_tokenizer

    byte_tokenizer(0).save_pretrained(tmp_path / "tokenizer")  # ids < the fixture's 1024
    out = tmp_path / "eval"
    assert cli_main(["eval", "env=libero_spatial", "policy=pi05_tiny", f"policy.vla.model_path={ASSETS / 'pi05_tiny'}",
                     "policy.pi.vision_head_dim=16", f"policy.pi.tokenizer_path={tmp_path / 'tokenizer'}",
                     "policy.vla.cameras=[rgb,wrist_rgb]", "policy.vla.mirror_images=true", "eval.trials_per_task=1",
                     "eval.tasks=[0]", "env.max_episode_steps=8", "env.image_size=32", "runner.progress=false",
                     f"runner.run_dir={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["policy"] == "pi0" and [t["episodes"] for t in result["tasks"]] == [1]
    assert result["provenance"]["weights"]["model_path"] == str(ASSETS / "pi05_tiny")
    assert "libero_spatial" in (out / "eval.md").read_text()
    assert len(list((out / "videos").glob("task_*.mp4"))) == 1


def test_demo_loss_draws_times_as_pi0_trains(monkeypatch):
    """``t ~ Beta(1.5, 1) * 0.999 + 0.001`` (mean 0.600), not uniform (mean 0.5)."""
    torch.manual_seed(0)
    policy = make_policy(compose(["policy=pi0_tiny"]).policy, {"rgb": ((56, 56, 3), torch.uint8)}, 4)
    drawn = []
    real = policy.model.flow_loss
    monkeypatch.setattr(policy.model, "flow_loss", lambda *a: drawn.append(a[-1]) or real(*a))
    obs = {"rgb": torch.zeros(400, 56, 56, 3, dtype=torch.uint8)}
    with torch.no_grad():
        policy.demo_loss(obs, torch.zeros(400, 4, 4))
    t = drawn[0]
    assert 0.001 <= t.min() and t.max() <= 1.0 and abs(t.mean().item() - 0.6004) < 0.04


def test_pi0s_value_reads_the_expert_and_trains_the_head_alone(monkeypatch):
    """pi0: the value head reads the expert (which sees the state token), detached: the value loss moves the
    head, not the expert; pi0.5: the VLM's pooled output (its expert sees no state)."""
    policy, obs, _, _ = _fixture_policy("pi0_tiny", monkeypatch)
    value = policy.value(obs)
    value.sum().backward()
    assert policy.critic[0].weight.grad is not None and policy.critic[0].weight.shape[1] == policy.size.expert.width
    assert all(p.grad is None for p in policy.model.expert.parameters())
    moved = dict(obs, state=obs["state"] + 1.0)
    with torch.no_grad():
        assert not torch.allclose(policy.value(moved), value)
    pi05, _, _, _ = _fixture_policy("pi05_tiny", monkeypatch)
    assert pi05.critic[0].weight.shape[1] == pi05.size.vlm.width


def test_lora_adapts_the_vlm_and_trains_the_expert_whole(monkeypatch):
    """policy.vla.lora_rank: adapters in the VLM (zero at first: lerobot's actions unchanged), its own weights
    frozen; the expert trains whole; with flow.train=expert (the VLM frozen) it is refused."""
    policy, obs, ref, _ = _fixture_policy("pi0_tiny", monkeypatch, **{"policy.vla.lora_rank": 4})
    lora = {n: p for n, p in policy.model.vlm.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert any("vision_tower" in n for n in lora) and any("language_model" in n for n in lora)
    assert not any(p.requires_grad for n, p in policy.model.vlm.named_parameters() if "lora_" not in n)
    assert all(p.requires_grad for p in policy.model.expert.parameters())
    noise = torch.zeros(len(ref["state"]), policy.noise_dim)
    noise[:, :policy.width] = torch.from_numpy(ref["noise"]).flatten(1)
    with torch.no_grad():
        actions = policy.to_env(policy.act(obs, deterministic=True, noise=noise)[0])
    torch.testing.assert_close(actions, torch.from_numpy(ref["actions"][:, :5]), rtol=1e-5, atol=1e-5)
    policy.demo_loss(obs, torch.from_numpy(ref["actions"][:, :5]))["loss"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)
    with pytest.raises(UserError, match="Pick one"):
        check_policy_config(compose(["policy=pi0_tiny", "policy.vla.lora_rank=4", "policy.flow.train=expert"]).policy,
                            8)
