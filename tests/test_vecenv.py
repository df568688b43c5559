"""The VecEnv protocol against real ManiSkill3 PushCube-v1 (physx_cpu, lavapipe)."""

import numpy as np
import pytest
import torch

from envs.base import EpisodeTracker, VecEnv, episode_rows
from envs.registry import make_vec_env
from tests.conftest import small_config

pytestmark = pytest.mark.integration  # simulators in this process or env processes: not the fast tier


@pytest.fixture(scope="module")
def env_cfg():
    return small_config().env


@pytest.fixture(scope="module")
def procs_env(env_cfg):
    env = make_vec_env(env_cfg, num_envs=4, num_procs=2)
    yield env
    env.close()


def test_shapes_and_dtypes(procs_env):
    env = procs_env
    assert isinstance(env, VecEnv)
    obs, _ = env.reset(seed=0)
    (dim,) = env.obs_spec["state"][0]
    assert obs["state"].shape == (4, dim) and obs["state"].dtype == torch.float32
    result = env.step(torch.zeros(4, env.action_dim))
    assert result.reward.shape == (4,) and result.reward.dtype == torch.float32
    for flag in (result.terminated, result.truncated, result.info["success"]):
        assert flag.shape == (4,) and flag.dtype == torch.bool
    assert result.info["final_obs"]["state"].shape == (4, dim)
    assert env.max_episode_steps == 50


def test_auto_reset_hands_back_final_observation(procs_env):
    env = procs_env
    env.set_ignore_terminations(True)  # every episode runs to the time limit
    obs, _ = env.reset(seed=3)
    first_obs = obs["state"].clone()
    for step in range(1, env.max_episode_steps + 1):
        previous = obs["state"].clone()
        result = env.step(torch.zeros(4, env.action_dim))
        obs = result.obs
        if step < env.max_episode_steps:
            assert not result.done.any()
    assert result.truncated.all() and not result.terminated.any()
    episode = result.info["episode"]
    assert episode["length"].tolist() == [env.max_episode_steps] * 4
    # the final observation continues the episode; the returned obs starts a new one
    final = result.info["final_obs"]["state"]
    assert (final - previous).abs().max() < (obs["state"] - previous).abs().max()
    assert not torch.equal(obs["state"], first_obs)  # a new episode, not a replay of seed 3
    env.set_ignore_terminations(False)


def test_same_seed_same_trajectory_in_process_and_subprocesses(env_cfg, procs_env):
    local = make_vec_env(env_cfg, num_envs=4, num_procs=0)
    try:
        actions = torch.rand(12, 4, local.action_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
        traces = []
        for env in (local, procs_env):
            obs, _ = env.reset(seed=11)
            trace = [obs["state"]]
            for a in actions:
                trace.append(env.step(a).obs["state"])
            traces.append(torch.stack(trace))
        torch.testing.assert_close(traces[0], traces[1], rtol=0, atol=0)
        # different envs of the batch got different seeds
        assert not torch.equal(traces[0][0, 0], traces[0][0, 1])
    finally:
        local.close()


def test_auto_reset_episodes_are_seeded_and_split_independent():
    """Episodes after an auto-reset repeat exactly, whether the batch is one VecEnv or two halves
    (pipeline micro-batches) seeded with the same per-env seeds."""
    cfg = small_config("env.max_episode_steps=3").env

    def run(splits: int) -> torch.Tensor:
        size = 4 // splits
        envs = [make_vec_env(cfg, num_envs=size, num_procs=0) for _ in range(splits)]
        try:
            trace = [torch.cat([e.reset(seed=[20 + s * size + i for i in range(size)])[0]["state"]
                                for s, e in enumerate(envs)])]
            for _ in range(7):  # two auto-resets
                trace.append(torch.cat([e.step(torch.zeros(size, e.action_dim)).obs["state"] for e in envs]))
            return torch.stack(trace)
        finally:
            for e in envs:
                e.close()

    whole = run(1)
    assert not torch.equal(whole[3], whole[0])  # a new initial state after the first auto-reset
    torch.testing.assert_close(run(2), whole, rtol=0, atol=0)
    torch.testing.assert_close(run(1), whole, rtol=0, atol=0)


def test_per_env_seed_list(procs_env):
    a, _ = procs_env.reset(seed=[5, 6, 7, 8])
    b, _ = procs_env.reset(seed=5)
    torch.testing.assert_close(a["state"], b["state"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="seeds"):
        procs_env.reset(seed=[1, 2])


@pytest.mark.parametrize("num_procs", [0, 2])
def test_a_grpo_group_starts_from_one_initial_state_and_acts_alike(env_cfg, num_procs):
    """GRPO compares a group's episodes: envs reset with one seed are one initial state, and stay
    alike under the same actions (the CPU simulator is deterministic per env)."""
    env = make_vec_env(env_cfg, num_envs=4, num_procs=num_procs)
    try:
        obs, _ = env.reset(seed=[5, 5, 9, 9])
        actions = torch.rand(4, env.action_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
        actions[1], actions[3] = actions[0], actions[2]
        for _ in range(3):
            obs = env.step(actions).obs
    finally:
        env.close()
    state = obs["state"]
    assert torch.equal(state[0], state[1]) and torch.equal(state[2], state[3])
    assert not torch.equal(state[0], state[2])


def test_render_gives_an_image(procs_env):
    procs_env.reset(seed=0)
    frame = procs_env.render(3)
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[-1] == 3
    assert frame.std() > 5  # not blank: robot, cube and floor are drawn


def test_episode_tracker_success_once_and_at_end():
    tracker = EpisodeTracker(3)
    done = torch.tensor([False, False, False])
    tracker.update(torch.ones(3), torch.tensor([True, False, False]), done)
    out = tracker.update(torch.ones(3), torch.tensor([False, False, True]), torch.tensor([True, True, True]))
    assert out["success_once"].tolist() == [True, False, True]
    assert out["success_at_end"].tolist() == [False, False, True]
    assert out["return"].tolist() == [2.0, 2.0, 2.0]
    assert out["length"].tolist() == [2, 2, 2]
    # finished envs start afresh
    out = tracker.update(torch.zeros(3), torch.zeros(3, dtype=torch.bool), torch.tensor([True, False, False]))
    assert out["length"][0] == 1 and out["success_once"][0].item() is False


def test_env_process_crash_is_reported(env_cfg):
    from envs.subproc import EnvCrashedError

    env = make_vec_env(env_cfg, num_envs=2, num_procs=1)
    try:
        env._procs[0].kill()
        with pytest.raises(EnvCrashedError, match="died"):
            env.step(torch.zeros(2, env.action_dim))
    finally:
        env.close(force=True)


@pytest.mark.gpu
def test_gpu_backend_matches_protocol(env_cfg):
    from dataclasses import replace

    env = make_vec_env(replace(env_cfg, sim_backend="physx_cuda"), num_envs=8)
    try:
        obs, _ = env.reset(seed=0)
        assert obs["state"].shape[0] == 8 and obs["state"].is_cuda
        env.set_ignore_terminations(True)
        for _ in range(env.max_episode_steps):
            result = env.step(torch.zeros(8, env.action_dim, device="cuda"))
        assert result.truncated.all()
        assert result.info["episode"]["length"].tolist() == [env.max_episode_steps] * 8
    finally:
        env.close()


def test_crashed_env_process_is_replaced_and_its_episodes_fail():
    """With env.restart_crashed a killed process is replaced: its envs' episodes end as failed
    (error, truncated, not successful), restart from their reset seeds, and the batch goes on."""
    import os
    import signal

    cfg = small_config("env.restart_crashed=true").env
    env = make_vec_env(cfg, num_envs=4, num_procs=2)
    reference = make_vec_env(cfg, num_envs=4, num_procs=0)
    try:
        env.reset(seed=[30, 31, 32, 33])
        zeros = torch.zeros(4, env.action_dim)
        env.step(zeros)
        os.kill(env._procs[1].pid, signal.SIGKILL)
        result = env.step(zeros)
        assert result.info["error"].tolist() == [False, False, True, True]
        assert result.truncated[2:].all() and not result.info["success"][2:].any()
        rows = episode_rows(result.info["episode"], result.done, result.info["error"])
        assert [(r["env"], r["error"], r["length"]) for r in rows] == [(2, True, 2), (3, True, 2)]
        assert env.restarts == 1
        fresh, _ = reference.reset(seed=[30, 31, 32, 33])
        torch.testing.assert_close(result.obs["state"][2:], fresh["state"][2:], rtol=0, atol=0)
        after = env.step(zeros)  # the batch goes on
        assert not after.info["error"].any()
    finally:
        env.close()
        reference.close()


# slow, 13 s: tests/test_subproc.py's hung render (found at its deadline, then replaced) and
# tests/test_faults.py's chaos test (a stopped env worker) cover it
@pytest.mark.slow
def test_hung_env_process_is_replaced():
    import os
    import signal

    cfg = small_config("env.restart_crashed=true", "env.timeout_s=3").env
    env = make_vec_env(cfg, num_envs=2, num_procs=2)
    try:
        env.reset(seed=[40, 41])
        os.kill(env._procs[0].pid, signal.SIGSTOP)  # alive but silent: a hung simulator
        result = env.step(torch.zeros(2, env.action_dim))
        assert result.info["error"].tolist() == [True, False] and env.restarts == 1
        assert not env.step(torch.zeros(2, env.action_dim)).info["error"].any()
    finally:
        env.close()
