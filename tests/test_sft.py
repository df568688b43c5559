"""Motion-planner demos in our control mode, SFT of a tiny VLA on them, and RL from its checkpoint
(real ManiSkill, CPU). The VLA is OpenVLA-OFT decoding chunks of 4 actions with proprioception."""

import dataclasses
import json

import imageio.v2 as imageio
import pytest
import torch

from embodied.algorithms.sft import chunk_targets, seeded_policy
from embodied.checkpoint import load_checkpoint
from embodied.config import compose
from embodied.sft import demos_for, train_sft
from envs.base import decode_instruction
from envs.registry import make_vec_env
from policies.registry import make_policy
from policies.vla.action_tokenizer import ActionStats

pytestmark = pytest.mark.integration  # motion-planner demos replayed in ManiSkill, Ray workers: not the fast tier

OVERRIDES = ["env=maniskill_pushcube_rgb", "env.image_size=64", "env.max_episode_steps=100",
             "policy=openvla_oft_tiny", "sft.demos=2", "sft.epochs=6", "sft.batch_size=32", "sft.lr=1e-3",
             "runner.progress=false"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return compose([*OVERRIDES, f"sft.demos_dir={tmp_path_factory.mktemp('demos')}"])


@pytest.fixture(scope="module")
def demos(cfg):
    return demos_for(cfg, progress=False)


def test_demos_replay_to_success_in_our_control_mode(cfg, demos):
    """The recorded delta actions, replayed from the demo's seed in pd_joint_delta_pos, solve the task."""
    assert len(demos.seeds) == 2 and demos.actions.shape[-1] == 8 and bool((demos.actions.abs() <= 1).all())
    assert decode_instruction(demos.obs["instruction"][0]) == "push the cube to the goal region"
    env = make_vec_env(cfg.env, num_envs=1, num_procs=0)
    try:
        for k, seed in enumerate(demos.seeds):
            obs, _ = env.reset(seed=seed)
            first = demos.obs["rgb"][demos.episode == k][0]
            assert torch.equal(obs["rgb"][0], first)  # the same scene the planner saw
            succeeded = False
            for action in demos.actions[demos.episode == k]:
                succeeded |= bool(env.step(action[None]).info["success"][0])
            assert succeeded, f"demo {k} (seed {seed}) did not replay to success"
    finally:
        env.close()


@pytest.fixture(scope="module")
def sft_run(cfg, demos, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft")
    return run_dir, train_sft(cfg, run_dir)


def test_sft_fits_the_demos_and_saves_a_loadable_checkpoint(cfg, demos, sft_run):
    tmp_path, stats = sft_run
    assert stats["demos"] == 2 and stats["steps"] == len(demos)
    state = load_checkpoint(tmp_path)
    policy = make_policy(cfg.policy, state["obs_spec"], state["action_dim"])
    demo_stats = ActionStats.from_actions(demos.actions)
    policy.set_action_stats(demo_stats)  # score the untrained model on the same bins as the trained one
    untrained_logp = _demo_logp(policy, demos)
    policy.set_action_stats(ActionStats.identity(state["action_dim"]))
    policy.load_state_dict(state["actor"]["policy"])
    # its bins span the demos' q01..q99, not [-1, 1]: the checkpoint carries those statistics
    assert torch.equal(policy.action_stats, demo_stats.as_tensor())
    # nats per token (the bins resolve the demos' range finely: 6 epochs on 2 demos gain ~0.5-0.6)
    assert _demo_logp(policy, demos) > untrained_logp + 0.4
    assert bool(policy.action_stats[2].any())
    assert stats["sft/token_accuracy"] > 1 / 256 * 5


def test_rl_from_the_sft_checkpoint_runs_chunks_and_trains_per_token(sft_run, ray_cluster, tmp_path):
    """``train checkpoint=<sft run>`` (its env and policy): chunked rollouts (2 decisions of 4 steps), a PPO update with
    one ratio per token, the final eval and its video with a frame per simulator step, and a fresh
    ``embodied eval`` on another layout that gives the final eval's rows."""
    sft_dir, _ = sft_run
    run_dir = tmp_path / "rl"
    from embodied.cli import main as cli_main  # in this process: fresh workers on the session's cluster

    assert cli_main(["train", f"checkpoint={sft_dir}", "env.num_envs=2", "env.max_episode_steps=8",
                     "placement.env_workers=1", "placement.env=0",
                     "algorithm.rollout_steps=2", "algorithm.num_minibatches=1", "algorithm.logprob_level=token",
                     "runner.total_env_steps=16", "eval.episodes=2", "eval.video_episodes=1", "runner.progress=false",
                     f"runner.run_dir={run_dir}"]) == 0
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["episodes"] == 2 and [r["length"] for r in result["rows"]] == [8, 8]
    assert result["training"]["env_steps"] == 16
    (video,) = (run_dir / "videos").glob("*.mp4")
    assert len(imageio.mimread(video)) == 1 + 8  # the reset, then a frame per simulator step, not per chunk
    # a fresh evaluation of the checkpoint, one env per worker process, gives the same episodes
    assert cli_main(["eval", f"checkpoint={run_dir}", "env.num_envs=1", "runner.progress=false",
                     f"runner.run_dir={tmp_path / 'fresh'}"]) == 0
    fresh = json.loads((tmp_path / "fresh" / "eval.json").read_text())
    assert [_without_env(r) for r in fresh["rows"]] == [_without_env(r) for r in result["rows"]]


def _without_env(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "env"}


def _demo_logp(policy, demos) -> float:
    with torch.no_grad():
        bins = policy.actions.bins(chunk_targets(demos.actions, demos.episode, policy.chunk_size)[:64]).flatten(1)
        token_logp, _, _ = policy.token_logprobs({k: v[:64] for k, v in demos.obs.items()}, bins.float())
    return float(token_logp.mean())


# replicate (a gradient all-reduce) is slow, for the suite's time: FSDP shards too, and replicate's update on
# two ranks is tests/test_data_parallel.py's (slow there as well: its FSDP cases run by default)
@pytest.mark.parametrize("strategy", [pytest.param("replicate", marks=pytest.mark.slow), "fsdp"])
def test_sft_on_two_ranks_gives_the_weights_of_one_rank(cfg, demos, ray_cluster, tmp_path, strategy):
    """``placement.actor_workers=2``: two SFT ranks (real Ray actors, gloo) train to the weights and
    Adam moments of the one in-process rank, and report its statistics. One epoch (5 steps, the
    last of 11 rows split 6 / 5) at lr 1e-4: Adam turns the summed halves' rounding into
    differences that grow with lr and steps (5e-6 after 5 steps at 1e-3, 5e-7 at 1e-4)."""
    one_cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, epochs=1, lr=1e-4))
    two_cfg = dataclasses.replace(one_cfg, placement=dataclasses.replace(
        cfg.placement, actor_workers=2, actor="0-1", data_parallel=strategy))
    stats_one = train_sft(one_cfg, tmp_path / "one")
    stats_two = train_sft(two_cfg, tmp_path / "two")
    one, two = (load_checkpoint(tmp_path / name)["actor"] for name in ("one", "two"))
    spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in demos.obs.items()}
    start = seeded_policy(cfg.policy, spec, 8, ActionStats.from_actions(demos.actions), cfg.runner.seed)
    moved = max((one["policy"][k].float() - v.float()).abs().max().item() for k, v in start.state_dict().items())
    assert moved > 1e-4, "SFT changed nothing: the comparison would prove nothing"
    assert one["policy"].keys() == two["policy"].keys()
    for key, value in one["policy"].items():
        torch.testing.assert_close(two["policy"][key], value, atol=1e-6, rtol=0, msg=key)
    assert one["optimizer"]["state"].keys() == two["optimizer"]["state"].keys()
    for index, moments in one["optimizer"]["state"].items():
        torch.testing.assert_close(two["optimizer"]["state"][index]["exp_avg"], moments["exp_avg"], atol=1e-6, rtol=0)
    assert torch.equal(two["generator"], one["generator"])  # the same shuffle stream, as far along
    for key in ("sft/loss", "sft/token_accuracy"):
        assert stats_two[key] == pytest.approx(stats_one[key], rel=1e-5), key


def test_sft_trains_a_flow_policy_with_the_flow_matching_loss(cfg, demos, tmp_path):
    """``embodied sft policy=mlp_flow``: the flow-matching loss on the demos' chunks (the trunk reads
    their ``state``), after which the ODE's chunks are far nearer the demos' than before."""
    overrides = [o for o in OVERRIDES if not o.startswith(("policy=", "sft.epochs", "sft.lr"))]
    flow_cfg = compose([*overrides, f"sft.demos_dir={cfg.sft.demos_dir}", "policy=mlp_flow", "policy.chunk_size=4",
                        "policy.net.hidden_sizes=[64,64]", "sft.epochs=40", "sft.lr=3e-3"])
    stats = train_sft(flow_cfg, tmp_path)
    assert set(stats) >= {"sft/loss", "demos", "steps"} and stats["demos"] == 2
    state = load_checkpoint(tmp_path)
    policy = make_policy(flow_cfg.policy, state["obs_spec"], state["action_dim"])
    policy.set_action_stats(ActionStats.from_actions(demos.actions))
    untrained = _chunk_error(policy, demos)
    policy.load_state_dict(state["actor"]["policy"])
    assert torch.equal(policy.action_stats, ActionStats.from_actions(demos.actions).as_tensor())
    assert _chunk_error(policy, demos) < 0.5 * untrained, (untrained, _chunk_error(policy, demos))


def _chunk_error(policy, demos) -> float:
    """Mean absolute error, in env units, of the ODE's chunks against the demos' (seeded start noise)."""
    targets = chunk_targets(demos.actions, demos.episode, policy.chunk_size)
    noise = torch.randn(len(targets), policy.noise_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        acted = policy.to_env(policy.act(demos.obs, deterministic=True, noise=noise)[0])
    return float((acted - targets).abs().mean())


@pytest.mark.slow  # 20-40 s, for the suite's time; pi0's act / evaluate / demo_loss: tests/test_pi0_policy.py
def test_sft_then_rl_of_a_tiny_pi0_run_end_to_end(cfg, demos, ray_cluster, tmp_path):
    """``embodied sft policy=pi0_tiny`` (the flow-matching loss through the VLM and the expert), then
    ``embodied train checkpoint=<sft run>``: Flow-SDE chains sampled by the rollout workers, re-scored
    by a PPO update, and the final evaluation on the ODE."""
    from embodied.cli import main as cli_main

    overrides = [o for o in OVERRIDES if not o.startswith(("policy=", "sft.epochs"))]
    pi0_cfg = compose([*overrides, f"sft.demos_dir={cfg.sft.demos_dir}", "policy=pi0_tiny", "sft.epochs=2"])
    stats = train_sft(pi0_cfg, tmp_path / "sft")
    assert stats["demos"] == 2 and stats["steps"] > 0
    run_dir = tmp_path / "rl"
    assert cli_main(["train", f"checkpoint={tmp_path / 'sft'}", "env.num_envs=2", "env.max_episode_steps=8",
                     "placement.env_workers=1", "placement.env=0", "algorithm.rollout_steps=2",
                     "algorithm.num_minibatches=1", "runner.total_env_steps=16", "eval.episodes=2",
                     "eval.video_episodes=0", "runner.progress=false", f"runner.run_dir={run_dir}"]) == 0
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["episodes"] == 2 and result["training"]["env_steps"] == 16
    trained = load_checkpoint(run_dir)["actor"]["policy"]
    sft = load_checkpoint(tmp_path / "sft")["actor"]["policy"]
    assert not torch.equal(trained["model.action_in_proj.weight"], sft["model.action_in_proj.weight"])
