"""The free simulator (envs/free_env.py): a registered env of the suite whose episodes are named by seeds,
that auto-resets and reports episodes like every backend, at next to no cost per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.common import UserError
from envs.free_env import SUCCESS_DISTANCE, FreeVecEnv, _uniform
from envs.registry import check_env_config, env_action_dim, env_obs_keys, make_vec_env
from envs.seeds import AutoResets, EpisodeStream, Purpose


def _env(*overrides: str):
    return make_vec_env(compose(["env=free", *overrides]).env)


def test_a_seed_names_the_same_episode_in_any_env_and_batch():
    small, large = _env("env.num_envs=3"), _env("env.num_envs=64")
    a, _ = small.reset(seed=[7, 8, 9])
    b, _ = large.reset(seed=list(range(100, 164)))
    b, _ = large.reset(seed=[9] + list(range(1, 64)))
    assert torch.equal(a["state"][2], b["state"][0]) and not torch.equal(a["state"][0], a["state"][1])
    state = a["state"][0]
    assert state.shape == (42,) and torch.equal(state[16:24], state[8:16] - state[:8]) and not state[24:].any()


def test_the_hash_is_uniform_and_fixed():
    draws = _uniform(np.arange(20_000), 4)
    assert draws.min() >= -1 and draws.max() < 1 and abs(draws.mean()) < 0.01
    assert abs(draws.std() - 1 / np.sqrt(3)) < 0.01
    assert np.array_equal(_uniform(np.array([5]), 2), _uniform(np.array([5, 6]), 2)[:1])


def test_moving_to_the_goal_succeeds_ends_the_episode_and_auto_resets_from_the_stream():
    env = FreeVecEnv(4, max_episode_steps=50, image_size=None)
    auto = AutoResets(EpisodeStream.of(1, Purpose.AUTO_RESET), first_env=4, num_envs=8, first_step=10)
    obs, _ = env.reset(seed=[1, 2, 3, 4], auto_resets=auto)
    toward = (obs["state"][:, 16:24] / 0.1).clamp(-1, 1)
    toward[1:] = 0  # envs 1-3 stand still
    for t in range(1, 40):
        step = env.step(toward)
        if step.done[0]:
            ended_at = t
            break
        toward[0] = (step.obs["state"][0, 16:24] / 0.1).clamp(-1, 1)
    assert step.terminated[0] and step.info["success"][0] and not step.done[1:].any()
    assert step.info["final_obs"]["state"][0, 16:24].norm() < SUCCESS_DISTANCE
    assert step.info["episode"]["length"][0] == ended_at and step.info["episode"]["success_once"][0]
    expected, _ = FreeVecEnv(1, 50, None).reset(seed=[auto.seed(0, ended_at)])
    assert torch.equal(step.obs["state"][0], expected["state"][0])  # env 4 of the batch, its t-th step


def test_episodes_end_at_the_limit_and_evaluations_ignore_success():
    env = FreeVecEnv(2, max_episode_steps=3, image_size=16)
    obs, _ = env.reset(seed=0)
    assert obs["rgb"].shape == (2, 16, 16, 3) and obs["rgb"].dtype == torch.uint8
    assert (obs["rgb"] == 255).any() and env.render(1).shape == (16, 16, 3)
    env.set_ignore_terminations(True)
    env.position = env.goal.clone()  # on the goal: success at every step, and the episode goes on
    results = [env.step(torch.zeros(2, 8)) for _ in range(3)]
    assert all(r.info["success"].all() for r in results) and not any(r.terminated.any() for r in results)
    assert [bool(r.truncated.all()) for r in results] == [False, False, True]


def test_the_free_env_is_known_before_it_is_built_and_bad_settings_are_refused():
    cfg = compose(["env=free", "env.obs_mode=rgb", "env.image_size=64"]).env
    assert env_action_dim(cfg) == 8 and env_obs_keys(cfg) == {"state": (42,), "rgb": (64, 64, 3)}
    for bad, named in (("env.task=push", "'reach'"), ("env.obs_mode=pixels", "'rgb'")):
        with pytest.raises(UserError, match=named):
            check_env_config(compose(["env=free", bad]).env)


@pytest.mark.integration  # both loops: the plain one and the workers on Ray
def test_the_overhead_bench_measures_both_loops_and_accounts_for_their_iterations(ray_cluster):
    """The bench's upper bound runs the same recorder and update as the workers; the stages of each loop add
    up to its iteration, and the table names both."""
    from embodied.bench.overhead import STAGES, markdown, run

    summary = run(["state-64", "env.num_envs=8", "algorithm.rollout_steps=4", "algorithm.update_epochs=1"],
                  iterations=1, progress=False, ways=("colocated",))
    [way] = summary["settings"][0]["ways"]
    for measured in (way["plain"], way["ours"]):
        assert measured["env_steps_per_iteration"] == 32 and measured["stages"]["update"] > 0
        assert sum(measured["stages"][k] for k in STAGES) == pytest.approx(measured["iteration_s"])
    assert way["ratio"] == pytest.approx(way["ours"]["env_steps_per_s"] / way["plain"]["env_steps_per_s"])
    table = markdown(summary)
    assert "| state, B=64 | colocated | " in table and "| plain (beside colocated) |" in table
