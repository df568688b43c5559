"""Public-checkpoint parity: our loaders act exactly as upstream's own code on checkpoints it built.

assets/reference holds tiny OpenVLA and OpenVLA-OFT (L1 and token) checkpoints in the public
on-disk format, built and run by openvla/openvla and moojink/openvla-oft (with moojink's
bidirectional transformers fork) in a throwaway venv (benchmarks/reference/make_fixtures.sh),
and what that code computed on real LIBERO and ManiSkill frames. Each test loads a fixture
directory as a user would (``policy.vla.model_path=<dir>``, the family's config file) and compares:
the eval script's image steps and processor output, prompt ids, logits (fp32), greedy tokens,
hidden states, un-normalised actions and what is sent to LIBERO after the gripper steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.base import encode_instruction
from tests.reference import (  # noqa: F401  (inference, offline: autouse fixtures, active by being imported)
    ASSETS,
    inference,
    l1_oft_matches_upstream,
    load_policy,
    observation,
    offline,
    openvla_matches_upstream,
    outputs,
)

LOGIT_IDS = slice(31488, 32064)  # what the fixtures kept of the vocabulary (text, action and padding ids)
# the frame each fixture case started from (inputs.npz) and whether the LIBERO mirror applies to it
RAW_FRAMES = {"libero_eval": (("libero_agentview", "libero_wrist"), True),
              "maniskill": (("maniskill_rgb", "gradient"), False), "gradient": (("gradient", "maniskill_rgb"), False)}


# -- OpenVLA -------------------------------------------------------------------------------------------
OPENVLA_CASES = ["libero_raw", "libero_eval", "maniskill", "gradient"]


@pytest.fixture(scope="module")
def openvla():
    """openvla_7b_libero.yaml's settings (mirror, JPEG + lanczos3, centre crop, LIBERO gripper)."""
    return load_policy("openvla_7b_libero", "openvla_tiny"), outputs("openvla_tiny")


def test_openvla_eval_images_are_upstream_libero_eval_images(openvla):
    """Rotate 180 degrees, JPEG round trip, lanczos3 to 224, 90% centre crop: bit-identical frames."""
    policy, ref = openvla
    upright = np.load(ASSETS / "inputs.npz")["libero_agentview"]
    mine = policy.adapter.frames(torch.from_numpy(upright)[None])[0].numpy()
    assert np.array_equal(mine, ref["libero_eval/image"])


@pytest.mark.parametrize("case", OPENVLA_CASES)
def test_openvla_acts_as_upstream_predict_action(openvla, case):
    policy, ref = openvla
    policy.adapter = type(policy.adapter)(gripper="libero")  # the case's frame is what upstream's processor saw
    openvla_matches_upstream(policy, ref, case, LOGIT_IDS)


# -- OpenVLA-OFT -------------------------------------------------------------------------------------
OFT_CASES = list(RAW_FRAMES)


@pytest.fixture(scope="module")
def oft_l1():
    return load_policy("openvla_oft_7b_libero", "openvla_oft_l1_tiny"), outputs("openvla_oft_l1_tiny")


@pytest.fixture(scope="module")
def oft_token():
    return (load_policy("openvla_oft_7b_simplevla", "openvla_oft_token_tiny"), outputs("openvla_oft_token_tiny"))


def raw_frames(case: str, cameras: int) -> list[np.ndarray]:
    """The case's frames as our envs give them (upright), before any eval-script step."""
    keys, _ = RAW_FRAMES[case]
    inputs = np.load(ASSETS / "inputs.npz")
    return [inputs[k] for k in keys[:cameras]]


def adapted(policy, case: str, frames: list[np.ndarray]) -> list[np.ndarray]:
    """Our adapter on the case's frames; the LIBERO mirror only for the LIBERO frames."""
    adapter = policy.adapter if RAW_FRAMES[case][1] else type(policy.adapter)(
        dataset_resize=policy.adapter.dataset_resize, center_crop=policy.adapter.center_crop)
    return [adapter.frames(torch.from_numpy(f)[None])[0].numpy() for f in frames]


@pytest.mark.parametrize("case", OFT_CASES)
def test_oft_l1_acts_as_upstream_get_vla_action(oft_l1, case):
    """Two images, proprio (q01 / q99 normalised), bidirectional attention, STOP, L1 head, 8 x 7 chunk."""
    policy, ref = oft_l1
    frames = adapted(policy, case, raw_frames(case, 2))
    assert all(np.array_equal(a, b) for a, b in zip(frames, ref[f"{case}/images"], strict=True))
    obs = observation(frames, str(ref[f"{case}/instruction"]), ref[f"{case}/state"])
    chunk, env_chunk = l1_oft_matches_upstream(policy, obs, ref, case)
    assert env_chunk.shape == (8, 7)
    # the L1 head's output of hidden states matched at 1e-5: float32 rounding (1.8e-6 with this venv's wheels)
    np.testing.assert_allclose(policy.actions.unnormalize(chunk.unflatten(-1, (8, 7)))[0].numpy(),
                               ref[f"{case}/actions"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(env_chunk, ref[f"{case}/env_actions"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", OFT_CASES)
def test_token_oft_acts_as_upstream_discrete_prediction(oft_token, case):
    """One image, STOP kept, bidirectional attention: logits and greedy tokens at the 56 action positions."""
    policy, ref = oft_token
    frames = adapted(policy, case, raw_frames(case, 1))
    assert np.array_equal(frames[0], ref[f"{case}/images"][0])
    obs = observation(frames, str(ref[f"{case}/instruction"]))
    saved, policy.adapter = policy.adapter, type(policy.adapter)(gripper=policy.adapter.gripper)
    try:
        logits, _, _ = policy._forward(obs)
        bins, _, _ = policy.act(obs, deterministic=True)
        env_chunk = policy.to_env(bins)[0].numpy()
    finally:
        policy.adapter = saved
    np.testing.assert_allclose(logits[0, :, LOGIT_IDS].numpy(), ref[f"{case}/logits"], rtol=0, atol=1e-5)
    assert policy.actions.action_ids[bins.long()][0].tolist() == ref[f"{case}/predicted_ids"].tolist()
    tokens = policy.actions.action_ids[bins.long()].unflatten(-1, (8, 7))
    np.testing.assert_allclose(policy.actions.decode(tokens)[0].numpy(), ref[f"{case}/actions"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(env_chunk, ref[f"{case}/env_actions"], rtol=0, atol=1e-6)


def test_token_oft_checkpoint_trains_with_lora_from_the_log_probs_it_sampled_with():
    """RL starts from a token OFT checkpoint: LoRA on it, rollout log-probs equal the update's, and a
    policy-gradient step reaches only the adapters and the value head."""
    policy = load_policy("openvla_oft_7b_simplevla", "openvla_oft_token_tiny", "policy.vla.lora_rank=4").train()
    inputs = np.load(ASSETS / "inputs.npz")
    frames = [np.stack([inputs["libero_agentview"], inputs["libero_wrist"]])]
    obs = {"rgb": torch.from_numpy(frames[0]), "instruction": torch.from_numpy(
        np.stack([encode_instruction(str(inputs["libero_instruction"])), encode_instruction("open the drawer")]))}
    bins, logp, _ = policy.act(obs, noise=torch.randn(2, policy.noise_dim, generator=torch.Generator().manual_seed(0)))
    with torch.enable_grad():
        token_logp, _, value = policy.evaluate(obs, bins)
        (-(token_logp.sum()) + value.square().sum()).backward()
    np.testing.assert_allclose(token_logp.detach().numpy(), logp.numpy(), rtol=0, atol=1e-5)
    touched = {n for n, p in policy.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert any("lora_" in n for n in touched) and any(n.startswith("value_head") for n in touched)
    assert all("lora_" in n or n.startswith("value_head") for n in touched)
    assert policy.to_env(bins).shape == (2, 8, 7)


@pytest.mark.slow  # 25 s of LIBERO start-up; the parity above covers what it acts with
def test_record_films_an_l1_oft_checkpoint_on_libero(tmp_path):
    """`embodied record` with a public-format checkpoint (no run): both cameras, proprio, the L1 head's chunks."""
    import imageio

    from tests.conftest import run_cli

    # 64 px frames for speed: the tiny checkpoint is told it may see other images than the 7B one's
    proc = run_cli("record", "env=libero_spatial", "env.max_episode_steps=16", "env.image_size=64",
                   "policy=openvla_oft_7b_libero", "policy.vla.camera_size=null",
                   f"policy.vla.model_path={ASSETS / 'openvla_oft_l1_tiny'}",
                   "policy.vla.dtype=float32", "policy.vla.unnorm_key=libero_spatial_no_noops", "eval.video_episodes=1",
                   f"runner.run_dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (video,) = tmp_path.glob("task_000_episode_0_seed_*.mp4")
    frames = imageio.mimread(video)
    assert len(frames) == 1 + 16 and not (frames[0] == frames[-1]).all()  # the checkpoint moved the arm


def test_token_oft_batch_acts_as_simplevla_rl_rollout(oft_token):
    """SimpleVLA-RL's own batched rollout (``generate_action_verl``, greedy, padded prompts of three
    lengths) against ours on the same batch: logits, the 56 tokens and the actions of every row."""
    policy, ref = oft_token
    simplevla = dict(np.load(ASSETS / "openvla_oft_token_tiny_simplevla_outputs.npz"))
    cases = [str(c) for c in simplevla["cases"]]
    obs = {"rgb": torch.from_numpy(np.stack([ref[f"{c}/images"][0] for c in cases])),
           "instruction": torch.from_numpy(np.stack([encode_instruction(str(ref[f"{c}/instruction"])) for c in cases]))}
    assert len(set(simplevla["attention_mask"].sum(1).tolist())) == 3  # three prompt lengths: padding matters
    saved, policy.adapter = policy.adapter, type(policy.adapter)()
    try:
        logits, _, _ = policy._forward(obs)
        bins, _, _ = policy.act(obs, deterministic=True)
    finally:
        policy.adapter = saved
    np.testing.assert_allclose(logits[..., LOGIT_IDS].numpy(), simplevla["logits"], rtol=0, atol=1e-5)
    tokens = policy.actions.action_ids[bins.long()]
    assert tokens.tolist() == simplevla["response_ids"].tolist()
    np.testing.assert_allclose(policy.actions.decode(tokens.unflatten(-1, (8, 7))).numpy(), simplevla["actions"],
                               rtol=0, atol=1e-6)


def test_openvla_batch_of_prompts_of_different_lengths_acts_as_each_alone(openvla):
    """Padding must not move a row's image patches or positions: instructions of three lengths in one
    batch give each row's batch-1 tokens and logits (a padded row once had its patches before its BOS)."""
    policy, ref = openvla
    frame = ref["libero_eval/image"]
    texts = [str(ref[f"{c}/instruction"]) for c in ("libero_eval", "maniskill", "gradient")]
    saved, policy.adapter = policy.adapter, type(policy.adapter)()
    try:
        batch = {"rgb": torch.from_numpy(np.stack([frame] * 3)),
                 "instruction": torch.from_numpy(np.stack([encode_instruction(t) for t in texts]))}
        together, _, _ = policy.act(batch, deterministic=True)
        tokens = policy.actions.action_ids[together.long()]
        logits, _, _ = policy._run(batch, tokens[:, :-1])
        for i, text in enumerate(texts):
            alone, _, _ = policy.act(observation([frame], text), deterministic=True)
            assert torch.equal(alone[0], together[i])
            row_logits, _, _ = policy._run(observation([frame], text), tokens[i:i + 1, :-1])
            torch.testing.assert_close(logits[i, -7:], row_logits[0, -7:], rtol=0, atol=1e-5)
    finally:
        policy.adapter = saved


@pytest.mark.parametrize("overrides, words", [
    (["policy.vla.unnorm_key=libero_goal"], ["libero_goal", "libero_spatial_no_noops"]),
    (["policy.vla.unnorm_key=bridge_orig", "env=maniskill_pushcube_rgb"],
     ["7-dim actions", "8-dim", "env.control_mode"]),
], ids=["unnorm_key not in the statistics", "checkpoint of another action size"])
def test_checkpoint_statistics_are_checked_before_any_worker_starts(overrides, words):
    """What start_workers checks first (the CLI turns it into one paragraph and exit 2: test_cli_errors.py)."""
    from envs.common import UserError
    from envs.registry import env_action_dim
    from policies.registry import check_policy_config

    cfg = compose(["env=libero_spatial", "policy=openvla_7b_libero", f"policy.vla.model_path={ASSETS / 'openvla_tiny'}",
                   *overrides])
    with pytest.raises(UserError) as err:
        check_policy_config(cfg.policy, env_action_dim(cfg.env))
    assert all(word in str(err.value) for word in words), str(err.value)
