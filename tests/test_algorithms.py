"""Algorithms are objects (embodied/algorithms/base.py): built by name, asked, never compared by name."""

import pytest
import torch

from embodied.algorithms.base import ALGORITHMS, Algorithm
from embodied.algorithms.grpo import GRPO
from embodied.algorithms.ppo import PPO, critic_parameters, critic_warmup_update, ppo_update
from embodied.algorithms.registry import make_algorithm
from embodied.checks import check_run_config
from embodied.config import compose
from envs.common import UserError
from envs.messages import Trajectory
from policies.registry import make_policy

OBS_SPEC = {"state": ((4,), torch.float32)}


@pytest.mark.parametrize("option, cls, episodic, group, success_ends", [
    ("ppo", PPO, False, 1, True), ("ppo_libero", PPO, False, 1, True), ("grpo", GRPO, True, 8, False),
])
def test_each_algorithm_option_builds_its_object(option, cls, episodic, group, success_ends):
    algorithm = make_algorithm(compose([f"algorithm={option}"]).algorithm)
    assert type(algorithm) is cls and isinstance(algorithm, Algorithm)
    assert (algorithm.episodic, algorithm.group_size, algorithm.success_ends_episode) == (episodic, group, success_ends)


def test_ppo_ignores_a_group_size_it_has_no_use_for():
    assert make_algorithm(compose(["algorithm.group_size=4"]).algorithm).group_size == 1


def test_an_unknown_algorithm_name_lists_the_registered_ones():
    with pytest.raises(UserError) as err:
        make_algorithm(compose(["algorithm.name=sacc"]).algorithm)
    assert "sacc" in str(err.value) and {"ppo", "grpo", "sac"} <= set(ALGORITHMS)
    assert all(name in str(err.value) for name in ALGORITHMS)


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.advantage=grpo"], ["algorithm.advantage=grpo", "algorithm=grpo"]),
    (["algorithm=grpo", "algorithm.advantage=gae"], ["algorithm.advantage=gae", "algorithm=ppo"]),
], ids=["PPO with an episode-scoring estimator", "GRPO with GAE"])
def test_an_estimator_that_does_not_fit_the_algorithm_is_refused(overrides, words):
    with pytest.raises(UserError) as err:
        check_run_config(compose(["env.num_envs=16", *overrides]))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_rollout_only_workers_skip_the_update_rules():
    """Auto placement's probes roll out 16 steps: GRPO's whole-episode rule is the update's, not theirs."""
    cfg = compose(["algorithm=grpo", "env.num_envs=16", "algorithm.rollout_steps=16"])
    with pytest.raises(UserError, match="shorter than an episode"):
        check_run_config(cfg)
    check_run_config(cfg, rollout_only=True)


def _batch(T: int = 4, B: int = 4) -> Trajectory:
    g = torch.Generator().manual_seed(0)
    return Trajectory(obs={"state": torch.randn(T, B, 4, generator=g)}, actions=torch.randn(T, B, 2, generator=g),
                      logprobs=torch.randn(T, B, generator=g) - 2, values=torch.randn(T, B, generator=g),
                      rewards=torch.randn(T, B, generator=g), dones=torch.zeros(T, B, dtype=torch.bool),
                      next_value=torch.zeros(B))


def _policy_and_optimizer(algorithm: Algorithm):
    torch.manual_seed(0)
    policy = make_policy(compose([]).policy, OBS_SPEC, 2)
    return policy, algorithm.make_optimizer(policy)


def test_ppo_update_is_critic_warm_up_then_ppo_bit_for_bit():
    """PPO.update picks by the iteration: the critic-only update before critic_warmup_iterations, then
    ppo_update; each equal, weights and statistics, to calling that function on a twin."""
    cfg = compose(["algorithm.critic_warmup_iterations=1", "algorithm.update_epochs=2",
                   "algorithm.num_minibatches=2"]).algorithm
    algorithm = make_algorithm(cfg)
    for iteration, function in ((0, critic_warmup_update), (1, ppo_update)):
        mine, my_optimizer = _policy_and_optimizer(algorithm)
        twin, twin_optimizer = _policy_and_optimizer(algorithm)
        stats = algorithm.update(mine, my_optimizer, _batch(), iteration=iteration,
                                 generator=torch.Generator().manual_seed(1))
        assert stats == function(twin, twin_optimizer, _batch(), cfg, generator=torch.Generator().manual_seed(1))
        for a, b in zip(mine.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b)
    assert stats["critic_only"] == 0.0


def test_ppo_optimizer_puts_the_critic_in_its_own_group_at_critic_lr():
    algorithm = make_algorithm(compose(["algorithm.critic_lr=1e-2"]).algorithm)
    policy, optimizer = _policy_and_optimizer(algorithm)
    actor, critic = optimizer.param_groups
    assert critic["lr"] == 1e-2 and actor["lr"] == algorithm.cfg.lr
    assert {id(p) for p in critic["params"]} == critic_parameters(policy)
