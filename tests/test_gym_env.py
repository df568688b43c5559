"""A user's own gymnasium env as an env of the suite (envs/gym_env.py): its observations, actions,
success, instruction and seeds through the contract, and bad ids refused before any env starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.base import decode_instruction
from envs.common import UserError
from envs.gym_env import GymEnv, GymSpec
from envs.registry import check_env_config, make_vec_env

USER_ENV = "tests.data.gym_user_env:LineReach-v0"


def _vec(num_procs: int):
    cfg = compose(["env=gym", f"env.task={USER_ENV}", "env.num_envs=2", f"env.num_procs={num_procs}"])
    return make_vec_env(cfg.env)


@pytest.mark.integration  # env processes
def test_a_users_env_keeps_the_contract_in_env_processes():
    """Dict observations by key (camera image uint8, the rest float32), the instruction as LIBERO's, actions
    mapped from [-1, 1] onto the box, success from info, the registered step limit, episodes named by seeds."""
    envs = _vec(num_procs=1)
    try:
        assert envs.action_dim == 1 and envs.max_episode_steps == 20
        assert envs.obs_spec["rgb"] == ((8, 8, 3), torch.uint8) and envs.obs_spec["state"] == ((2,), torch.float32)
        again, _ = envs.reset(seed=[3, 5])
        obs, _ = envs.reset(seed=[3, 4])
        assert torch.equal(obs["state"][0], again["state"][0]) and not torch.equal(obs["state"][1], again["state"][1])
        assert decode_instruction(obs["instruction"][0]) == "move the point to the goal"
        x, goal = obs["state"][:, 0].double(), obs["state"][:, 1].double()
        away = -torch.sign(goal - x)  # a step away from the goal: no success, no auto-reset
        step = envs.step((0.25 * away).float()[:, None])  # 0.25 in [-1, 1] is 0.5 in the env's [-2, 2]
        torch.testing.assert_close(step.obs["state"][:, 0].double(), x + 0.5 * away, rtol=0, atol=1e-6)
        # one step that lands each point on its goal (the policy's scale: the box's half-width is 2)
        envs.reset(seed=[3, 4])
        step = envs.step(((goal - x) / 2).float()[:, None])
        assert step.info["success"].all() and step.terminated.all()
        assert envs.render(0).shape == (64, 64, 3)
    finally:
        envs.close()


def test_bad_gymnasium_envs_are_refused_with_the_fix():
    with pytest.raises(UserError, match="not a registered gymnasium env"):
        check_env_config(compose(["env=gym", "env.task=NoSuchEnv-v0"]).env)
    with pytest.raises(UserError, match="cannot import 'no_such_module'"):
        check_env_config(compose(["env=gym", "env.task=no_such_module:Reach-v0"]).env)
    with pytest.raises(UserError, match="1-D Box"):
        check_env_config(compose(["env=gym", "env.task=CartPole-v1"]).env)  # discrete actions
    check_env_config(compose(["env=gym", f"env.task={USER_ENV}"]).env)


def test_a_built_in_box_env_is_a_state_env():
    """Pendulum-v1 (registered with 200 steps) under env.max_episode_steps=250: gymnasium's own time limit moves
    too, so the episode is truncated at 250, not 200."""
    env = GymEnv(GymSpec("Pendulum-v1", 250))
    try:
        first = env.reset(7)
        assert set(first) == {"state"} and first["state"].dtype == np.float32 and env.max_episode_steps == 250
        np.testing.assert_array_equal(env.reset(7)["state"], first["state"])
        truncated = [env.step(np.zeros(1))[3] for _ in range(250)]
        assert not any(truncated[:-1]) and truncated[-1]
    finally:
        env.close()


def test_an_env_that_cannot_render_is_refused_before_a_run_that_records_videos():
    """A run recording videos of an env without a renderer would fail at its end: it is refused up front, and
    runs without videos pass."""
    from embodied.checks import check_run_config

    blind = "tests.data.gym_user_env:BlindLineReach-v0"
    with pytest.raises(UserError, match="cannot render video frames.*set both to 0"):
        check_run_config(compose(["env=gym", f"env.task={blind}"]))
    check_run_config(compose(["env=gym", f"env.task={blind}", "eval.video_episodes=0", "eval.videos_per_task=0"]))
    check_run_config(compose(["env=gym", f"env.task={USER_ENV}"]))  # renders: videos stay on
