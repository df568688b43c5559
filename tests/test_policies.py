"""Policies: registry, shapes, and the CNN on real ManiSkill camera observations."""

import pytest
import torch

from embodied.config import compose
from embodied.errors import UserError
from envs.registry import make_vec_env
from policies.registry import make_policy

STATE_SPEC = {"state": ((35,), torch.float32)}


def test_mlp_shapes_and_log_prob_consistency():
    policy = make_policy(compose([]).policy, STATE_SPEC, 8)
    obs = {"state": torch.randn(5, 35)}
    actions, logprob, value = policy.act(obs)
    assert actions.shape == (5, 8) and logprob.shape == (5,) and value.shape == (5,)
    new_logprob, entropy, new_value = policy.evaluate(obs, actions)
    torch.testing.assert_close(new_logprob, logprob)
    torch.testing.assert_close(new_value, value)
    assert entropy.shape == (5,)
    mean_action = policy.act(obs, deterministic=True)[0]
    torch.testing.assert_close(mean_action, policy.actor_mean(obs))


def test_unknown_policy_name_is_a_user_error():
    cfg = compose([])
    cfg.policy.name = "transformr"
    with pytest.raises(UserError, match="transformer|Known: cnn, mlp"):
        make_policy(cfg.policy, STATE_SPEC, 8)


def test_cnn_on_rendered_camera_observations():
    cfg = compose(["env=maniskill_pushcube_rgb", "policy=cnn"])
    env = make_vec_env(cfg.env, num_envs=2, num_procs=0)
    try:
        obs, _ = env.reset(seed=0)
        assert obs["rgb"].dtype == torch.uint8 and obs["rgb"].shape == (2, 64, 64, 3)
        assert obs["rgb"].float().std() > 5  # a real image, not zeros
        policy = make_policy(cfg.policy, env.obs_spec, env.action_dim)
        actions, logprob, value = policy.act(obs)
        assert actions.shape == (2, env.action_dim) and value.shape == (2,)
        result = env.step(actions.clamp(-1, 1))
        assert result.obs["rgb"].shape == (2, 64, 64, 3)
    finally:
        env.close()


def test_cnn_rejects_state_only_envs():
    cfg = compose(["policy=cnn"])
    with pytest.raises(UserError, match="obs_mode: rgb"):
        make_policy(cfg.policy, STATE_SPEC, 8)
