"""SAC (embodied/algorithms/sac.py), its replay buffer and transitions (replay.py) and policy=mlp_sac:
the soft Bellman target on hand-computed cases, truncation against termination, n-step sums, the
buffer's wrap-around and seeded sampling, a checkpointed algorithm continuing with the same batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from embodied.algorithms.registry import make_algorithm
from embodied.algorithms.replay import ReplayBuffer, Transitions, transitions
from embodied.algorithms.sac import soft_bellman_target
from embodied.checks import check_run_config
from embodied.config import compose
from envs.common import UserError
from envs.messages import Trajectory
from policies.mlp_sac import squashed_logprob
from policies.registry import make_policy

STATE, ACTIONS = 6, 3


def _trajectory(rewards, dones, terminated) -> Trajectory:
    """A ``[T, B]`` trajectory whose observations encode (step, env): ``obs = 100 * t + b``,
    ``next_obs = 100 * t + b + 0.5``."""
    rewards = torch.tensor(rewards, dtype=torch.float32)
    steps, envs = rewards.shape
    code = 100 * torch.arange(steps)[:, None] + torch.arange(envs)[None, :]
    state = code[..., None].float().expand(steps, envs, STATE)
    return Trajectory(obs={"state": state}, actions=torch.zeros(steps, envs, ACTIONS),
                      logprobs=torch.zeros(steps, envs), values=torch.zeros(steps, envs),
                      rewards=rewards, dones=torch.tensor(dones),
                      next_value=torch.zeros(envs), next_obs={"state": state + 0.5},
                      terminated=torch.tensor(terminated))


def _sac(*overrides: str):
    cfg = compose(["algorithm=sac", "policy=mlp_sac", *overrides])
    return cfg, make_algorithm(cfg.algorithm)


# -- the target ------------------------------------------------------------------------------------
def test_soft_bellman_target_on_hand_computed_cases():
    rewards = torch.tensor([1.0, 0.5, -2.0])
    discounts = torch.tensor([0.8, 0.0, 0.64])
    next_q = torch.tensor([[3.0, 10.0, -1.0], [2.0, 20.0, 4.0]])  # two critics: the target takes the smaller
    next_logprob = torch.tensor([-1.0, 5.0, 2.0])
    alpha = 0.5
    expected = torch.tensor([1.0 + 0.8 * (2.0 + 0.5), 0.5, -2.0 + 0.64 * (-1.0 - 1.0)])
    torch.testing.assert_close(soft_bellman_target(rewards, discounts, next_q, next_logprob, alpha), expected)


@pytest.mark.parametrize("rule, terminal_bootstraps", [("time_limit", False), ("all_ends", True)])
def test_truncation_bootstraps_and_termination_only_if_the_rule_says(rule, terminal_bootstraps):
    """Env 0 runs on, env 1 is cut by a time limit, env 2 reaches a terminal state."""
    _, sac = _sac(f"algorithm.bootstrap={rule}", "algorithm.gamma=0.9")
    batch = _trajectory([[1.0, 2.0, 3.0]], [[False, True, True]], [[False, False, True]])
    t = sac.transitions(batch)
    torch.testing.assert_close(t.discounts, torch.tensor([0.9, 0.9, 0.9 if terminal_bootstraps else 0.0]))
    torch.testing.assert_close(t.rewards, torch.tensor([1.0, 2.0, 3.0]))
    # where an episode ended, the target reads the episode's final observation, not the reset's
    torch.testing.assert_close(t.next_obs["state"][:, 0], torch.tensor([0.5, 1.5, 2.5]))


def test_n_step_returns_stop_at_episode_ends_and_at_the_end_of_the_rollout():
    gamma = 0.5
    rewards = [[1.0, 10.0], [2.0, 20.0], [4.0, 40.0], [8.0, 80.0]]
    dones = [[False, False], [False, True], [False, False], [False, False]]
    terminated = [[False, False], [False, True], [False, False], [False, False]]
    batch = _trajectory(rewards, dones, terminated)
    going = ~batch.dones  # terminations end the bootstrap
    t = transitions(batch, gamma, 3, going)
    # env 0: three steps from t = 0 and 1; two from t = 2 (the rollout ends); one from t = 3
    expected_rewards = {(0, 0): 1 + 0.5 * 2 + 0.25 * 4, (1, 0): 2 + 0.5 * 4 + 0.25 * 8, (2, 0): 4 + 0.5 * 8,
                        (3, 0): 8.0,
                        # env 1 terminates at t = 1: the sums from t = 0 and 1 stop there, with no bootstrap
                        (0, 1): 10 + 0.5 * 20, (1, 1): 20.0, (2, 1): 40 + 0.5 * 80, (3, 1): 80.0}
    expected_discounts = {(0, 0): 0.125, (1, 0): 0.125, (2, 0): 0.25, (3, 0): 0.5,
                          (0, 1): 0.0, (1, 1): 0.0, (2, 1): 0.25, (3, 1): 0.5}
    expected_next = {(0, 0): 200.5, (1, 0): 300.5, (2, 0): 300.5, (3, 0): 300.5,
                     (0, 1): 101.5, (1, 1): 101.5, (2, 1): 301.5, (3, 1): 301.5}
    for (step, env), reward in expected_rewards.items():
        i = step * 2 + env
        assert t.rewards[i].item() == pytest.approx(reward), (step, env)
        assert t.discounts[i].item() == pytest.approx(expected_discounts[step, env]), (step, env)
        assert t.next_obs["state"][i, 0].item() == expected_next[step, env], (step, env)
        assert t.obs["state"][i, 0].item() == 100 * step + env


def test_one_step_transitions_are_the_trajectory_itself():
    batch = _trajectory([[1.0, 2.0], [3.0, 4.0]], [[False, True], [False, False]], [[False, False], [False, False]])
    t = transitions(batch, 0.8, 1, torch.ones(2, 2, dtype=torch.bool))
    torch.testing.assert_close(t.rewards, batch.rewards.flatten())
    torch.testing.assert_close(t.next_obs["state"], batch.next_obs["state"].flatten(0, 1))
    torch.testing.assert_close(t.discounts, torch.full((4,), 0.8))


# -- the replay buffer -----------------------------------------------------------------------------
def _numbered(start: int, n: int) -> Transitions:
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return Transitions({"state": ids[:, None].expand(n, STATE).clone()}, ids[:, None].expand(n, ACTIONS).clone(),
                       ids.clone(), {"state": ids[:, None].expand(n, STATE) + 0.5}, torch.ones(n))


def test_the_buffer_wraps_over_its_oldest_transitions():
    buffer = ReplayBuffer(10)
    buffer.add(_numbered(0, 7))
    buffer.add(_numbered(7, 6))  # 13 added: 10, 11, 12 overwrite 0, 1, 2
    assert len(buffer) == 10 and buffer.position == 3 and buffer.added == 13
    assert buffer.storage.rewards.tolist() == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    buffer.add(_numbered(13, 25))  # more than the capacity at once: its newest 10
    assert sorted(buffer.storage.rewards.tolist()) == list(range(28, 38))
    assert torch.equal(buffer.storage.next_obs["state"][:, 0], buffer.storage.rewards + 0.5)


def test_the_same_seed_samples_the_same_transitions():
    buffer = ReplayBuffer(50)
    buffer.add(_numbered(0, 30))
    first = buffer.sample(64, torch.Generator().manual_seed(3))
    again = buffer.sample(64, torch.Generator().manual_seed(3))
    other = buffer.sample(64, torch.Generator().manual_seed(4))
    assert torch.equal(first.rewards, again.rewards)
    assert not torch.equal(first.rewards, other.rewards)
    assert first.rewards.max() < 30  # only what was added
    assert torch.equal(first.obs["state"][:, 0], first.rewards)  # fields stay together


def test_a_saved_buffer_samples_as_the_original():
    buffer = ReplayBuffer(8)
    buffer.add(_numbered(0, 11))
    restored = ReplayBuffer(8)
    restored.load_state_dict(copy.deepcopy(buffer.state_dict()))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(buffer.sample(20, g1).rewards, restored.sample(20, g2).rewards)
    buffer.add(_numbered(11, 3))
    restored.add(_numbered(11, 3))
    assert torch.equal(buffer.storage.rewards, restored.storage.rewards)


def test_buffer_memory_is_stated_for_a_full_buffer():
    # 42 float32 state twice, 8 float32 actions, reward and discount
    assert ReplayBuffer.bytes_for(1000, {"state": ((42,), "float32")}, 8) == 1000 * (2 * 168 + 32 + 8)
    _, sac = _sac()
    assert "MiB" in sac.describe({"state": ((42,), torch.float32)}, 8)[0]


def _demos():
    """Two demos: the first solves the task at its 2nd of 4 steps, the second at its last of 3."""
    from envs.demos import Demos

    ids = torch.arange(7, dtype=torch.float32)
    return Demos({"state": ids[:, None].expand(7, STATE).clone()}, torch.ones(7, ACTIONS),
                 torch.tensor([0, 0, 0, 0, 1, 1, 1]), [5, 6], "PushCube-v1", "push",
                 rewards=ids / 10, success=torch.tensor([False, True, True, False, False, False, True]),
                 next_obs={"state": ids[:, None].expand(7, STATE) + 0.5})


@pytest.mark.parametrize("bootstraps_terminal", [False, True])
def test_demo_transitions_end_each_demo_where_it_first_solves_the_task(bootstraps_terminal):
    from embodied.algorithms.replay import demo_transitions

    t = demo_transitions(_demos(), 0.8, bootstraps_terminal)
    assert t.obs["state"][:, 0].tolist() == [0, 1, 4, 5, 6]  # demo 0 after its success is not an episode
    torch.testing.assert_close(t.rewards, torch.tensor([0.0, 0.1, 0.4, 0.5, 0.6]))
    terminal = 0.8 if bootstraps_terminal else 0.0
    torch.testing.assert_close(t.discounts, torch.tensor([0.8, terminal, 0.8, 0.8, terminal]))
    torch.testing.assert_close(t.next_obs["state"][:, 0], torch.tensor([0.5, 1.5, 4.5, 5.5, 6.5]))


def test_rlpd_draws_its_share_of_every_batch_from_the_demos():
    _, sac = _sac("algorithm.sac.demo_fraction=0.25", "algorithm.sac.batch_size=40")
    assert sac.uses_demos
    sac.buffer.add(_numbered(100, 50))
    sac.load_demos(_numbered(0, 5))
    batch = sac.sample(torch.Generator().manual_seed(0))
    assert len(batch) == 40 and int((batch.rewards < 5).sum()) == 10


def test_rlpd_needs_a_task_with_a_motion_planner():
    with pytest.raises(UserError, match="no planner"):
        check_run_config(compose(["algorithm=sac", "policy=mlp_sac", "algorithm.sac.demo_fraction=0.5",
                                  "env.task=LiftPegUpright-v1"]))


# -- the policy ------------------------------------------------------------------------------------
def _policy(seed: int = 0, *overrides: str):
    torch.manual_seed(seed)
    cfg = compose(["algorithm=sac", "policy=mlp_sac", "policy.net.hidden_sizes=[32,32]", *overrides])
    return make_policy(cfg.policy, {"state": ((STATE,), "float32")}, ACTIONS), cfg


def test_squashed_logprob_is_the_density_of_the_tanh_of_a_gaussian():
    """Against the change of variables written out: N(u; m, s) / prod(1 - tanh(u)^2)."""
    mean, log_std = torch.tensor([[0.3, -1.0]]), torch.tensor([[-0.5, 0.2]])
    u = torch.tensor([[0.7, -2.5]])
    gaussian = torch.distributions.Normal(mean, log_std.exp()).log_prob(u).sum()
    expected = gaussian - torch.log(1 - torch.tanh(u) ** 2).sum()
    assert squashed_logprob(u, mean, log_std).item() == pytest.approx(expected.item(), abs=1e-5)


def test_sac_actions_stay_in_the_box_and_evaluate_scores_them_as_act_did():
    policy, _ = _policy()
    obs = {"state": torch.randn(64, STATE)}
    actions, logprob, _ = policy.act(obs, noise=3 * torch.randn(64, ACTIONS))
    assert actions.abs().max() < 1
    again, _, _ = policy.evaluate(obs, actions)
    unsaturated = actions.abs().max(-1).values < 0.999
    torch.testing.assert_close(again[unsaturated], logprob[unsaturated], rtol=1e-4, atol=1e-3)
    greedy, _, _ = policy.act(obs, deterministic=True)
    torch.testing.assert_close(greedy, torch.tanh(policy.actor_heads(obs)[0]))


def test_sac_refuses_a_policy_without_q_critics_and_several_actor_ranks():
    with pytest.raises(UserError, match="policy=mlp_sac"):
        check_run_config(compose(["algorithm=sac"]))
    with pytest.raises(UserError, match="actor_workers"):
        check_run_config(compose(["algorithm=sac", "policy=mlp_sac", "placement.actor_workers=2"]))


@pytest.mark.parametrize("overrides, words", [
    (["runner.collection=async"], ["algorithm=ppo", "off-policy", "runner.collection=sync"]),
    (["algorithm=sac", "policy=mlp_sac", "runner.weight_sync_every=3"], ["runner.collection=async"]),
    (["algorithm=sac", "policy=mlp_sac", "runner.collection=later"], ["runner.collection", "async"]),
    (["algorithm=sac", "policy=mlp_sac", "runner.collection=async", "placement.offload=always"],
     ["placement.offload=never"]),
])
def test_collection_mistakes_are_refused_before_workers_start(overrides, words):
    with pytest.raises(UserError) as err:
        check_run_config(compose(overrides))
    assert all(w in str(err.value) for w in words), str(err.value)


# -- the update ------------------------------------------------------------------------------------
def _random_batch(seed: int, steps: int = 4, envs: int = 8) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(steps, envs, STATE, generator=g)
    dones = torch.rand(steps, envs, generator=g) < 0.2
    return Trajectory(obs={"state": state}, actions=torch.rand(steps, envs, ACTIONS, generator=g) * 2 - 1,
                      logprobs=torch.zeros(steps, envs), values=torch.zeros(steps, envs),
                      rewards=torch.rand(steps, envs, generator=g), dones=dones, next_value=torch.zeros(envs),
                      next_obs={"state": torch.randn(steps, envs, STATE, generator=g)},
                      terminated=dones & (torch.rand(steps, envs, generator=g) < 0.5))


def _trained(policy, sac, optimizer, seeds, generator):
    return [sac.update(policy, optimizer, _random_batch(s), iteration=i, generator=generator)
            for i, s in enumerate(seeds)]


def test_updates_start_at_learning_starts_and_take_utd_steps_per_transition():
    policy, cfg = _policy(0, "algorithm.sac.learning_starts=64", "algorithm.sac.utd=0.25",
                          "algorithm.sac.batch_size=16")
    sac = make_algorithm(cfg.algorithm)
    optimizer = sac.make_optimizer(policy)
    stats = _trained(policy, sac, optimizer, [0, 1, 2], torch.Generator().manual_seed(0))
    assert [s["gradient_steps"] for s in stats] == [0, 8, 16]  # 32 transitions each; none before 64 are held
    assert stats[1]["buffer_size"] == 64 and "q_loss" in stats[1] and "q_loss" not in stats[0]
    assert stats[2]["replay_ratio"] == pytest.approx(16 * 16 / 96)


def test_auto_placement_times_a_steady_state_update_and_counts_the_full_buffer():
    """The profiler's update takes ``utd`` gradient steps per transition from the first (no warm-up),
    leaves the run's own buffer empty, and the actor's memory holds the full buffer."""
    from scheduler.profiler import measure_policy

    policy, cfg = _policy(0, "algorithm.sac.learning_starts=4000", "algorithm.sac.utd=0.5",
                          "algorithm.sac.batch_size=16", "algorithm.sac.buffer_size=100000")
    sac = make_algorithm(cfg.algorithm)
    stats = sac.profiled_update(policy, sac.make_optimizer(policy), _random_batch(0, steps=4, envs=8))
    assert stats["gradient_steps"] == 16 and len(sac.buffer) == 0
    full_mib = sac.resident_mib({"state": ((STATE,), torch.float32)}, ACTIONS)
    assert full_mib == pytest.approx(100_000 * (2 * STATE + ACTIONS + 2) * 4 / 2**20)  # s, s', a, r, discount
    measured = measure_policy(cfg, {"state": torch.randn(8, STATE)}, ACTIONS, [4, 8], [8, 16], 1,
                              torch.device("cpu"), sac)
    assert measured["actor_memory"].fixed >= full_mib


def test_critic_steps_leave_the_actor_and_actor_steps_leave_the_critics():
    policy, cfg = _policy(0, "algorithm.sac.learning_starts=0", "algorithm.sac.batch_size=16",
                          "algorithm.sac.actor_every=2")
    sac = make_algorithm(cfg.algorithm)
    optimizer = sac.make_optimizer(policy)
    sac.update(policy, optimizer, _random_batch(0, steps=1, envs=2), generator=torch.Generator().manual_seed(0))
    before = copy.deepcopy(policy.state_dict())
    generator = torch.Generator().manual_seed(1)
    sac.gradient_step(policy, optimizer, generator)  # step 2 of actor_every=2: both
    moved = {k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.startswith("critic.") for k in moved) and any(not k.startswith("critic.") for k in moved)
    before = copy.deepcopy(policy.state_dict())
    sac.gradient_step(policy, optimizer, generator)  # step 3: the critics only
    moved = {k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all(k.startswith("critic.") for k in moved)


def test_the_target_critics_follow_by_polyak_averaging():
    policy, cfg = _policy(0, "algorithm.sac.learning_starts=0", "algorithm.sac.batch_size=8", "algorithm.sac.tau=0.1")
    sac = make_algorithm(cfg.algorithm)
    optimizer = sac.make_optimizer(policy)
    sac.update(policy, optimizer, _random_batch(0, steps=1, envs=1), generator=torch.Generator().manual_seed(0))
    target_before = {k: v.clone() for k, v in sac.target.items()}
    sac.gradient_step(policy, optimizer, torch.Generator().manual_seed(1))
    for name, param in policy.critic.named_parameters():
        torch.testing.assert_close(sac.target[name], target_before[name] + 0.1 * (param.detach() - target_before[name]))


def test_the_temperature_rises_when_entropy_is_below_target():
    policy, cfg = _policy(0, "algorithm.sac.learning_starts=0", "algorithm.sac.batch_size=8",
                          "algorithm.sac.target_entropy=100", "algorithm.sac.alpha_lr=0.01")
    sac = make_algorithm(cfg.algorithm)
    optimizer = sac.make_optimizer(policy)
    stats = _trained(policy, sac, optimizer, [0, 1], torch.Generator().manual_seed(0))
    assert stats[-1]["alpha"] > 0.2 and stats[-1]["entropy"] < 100


def test_a_checkpointed_sac_continues_with_the_same_buffer_and_the_same_next_batch():
    """Save mid-run (policy, optimizer, algorithm state, generator, torch RNG), load into fresh objects:
    the next updates give bit-identical weights and statistics."""
    policy, cfg = _policy(0, "algorithm.sac.learning_starts=16", "algorithm.sac.batch_size=16")
    sac = make_algorithm(cfg.algorithm)
    optimizer = sac.make_optimizer(policy)
    generator = torch.Generator().manual_seed(5)
    _trained(policy, sac, optimizer, [0, 1], generator)
    saved = copy.deepcopy({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                           "algorithm": sac.state_dict(), "generator": generator.get_state(),
                           "torch_rng": torch.get_rng_state()})
    expected = _trained(policy, sac, optimizer, [2, 3], generator)

    restored, _ = _policy(1, "algorithm.sac.learning_starts=16", "algorithm.sac.batch_size=16")
    restored.load_state_dict(saved["policy"])
    sac2 = make_algorithm(cfg.algorithm)
    optimizer2 = sac2.make_optimizer(restored)
    optimizer2.load_state_dict(saved["optimizer"])
    sac2.load_state_dict(saved["algorithm"])
    generator2 = torch.Generator()
    generator2.set_state(saved["generator"])
    torch.set_rng_state(saved["torch_rng"])
    assert len(sac2.buffer) == 64
    got = _trained(restored, sac2, optimizer2, [2, 3], generator2)
    assert got == expected
    for k, v in policy.state_dict().items():
        assert torch.equal(v, restored.state_dict()[k]), k


def test_without_save_buffer_a_checkpoint_holds_no_transitions():
    policy, cfg = _policy(0, "algorithm.sac.save_buffer=false", "algorithm.sac.learning_starts=1000")
    sac = make_algorithm(cfg.algorithm)
    sac.update(policy, sac.make_optimizer(policy), _random_batch(0))
    assert sac.state_dict()["buffer"] is None
    assert math.isclose(sac.state_dict()["log_alpha"].item(), math.log(0.2), rel_tol=1e-6)


# -- a whole run -----------------------------------------------------------------------------------
def test_sac_trains_checkpoints_its_buffer_and_a_resumed_run_continues_it(ray_cluster, tmp_path):
    """Real workers: 3 iterations of 4 envs x 10 steps collected asynchronously (weights synced every
    2), updates from the second; a resumed run (in lockstep) loads the 120 transitions, the target
    critics and the step count, and its first update adds to them."""
    from embodied.checkpoint import load_checkpoint
    from embodied.trainer import Trainer
    from tests.conftest import small_config, tb_scalars, train_between_weights

    sac_run = ["algorithm=sac", "policy=mlp_sac", "policy.net.hidden_sizes=[32,32]", "algorithm.rollout_steps=10",
               "algorithm.sac.learning_starts=41", "algorithm.sac.batch_size=16", "runner.checkpoint_every=1",
               "runner.eval_every=0", "eval.episodes=4", "eval.video_episodes=0"]
    cfg = small_config(f"runner.run_dir={tmp_path}", "runner.total_env_steps=120", "runner.collection=async",
                       "runner.weight_sync_every=2", *sac_run)
    before, _, after = train_between_weights(cfg, tmp_path)
    assert all(not torch.equal(before[k], after[k]) for k in before), "every parameter trains"
    state = load_checkpoint(tmp_path)
    saved = state["actor"]["algorithm"]
    assert saved["buffer"]["size"] == 120 and saved["gradient_steps"] == 40  # utd 0.5 x 2 iterations of 40
    assert tb_scalars(tmp_path, "train/buffer_size")[-1] == (120, 120.0)
    # rollout 1 ran during update 0 with the first weights; rollout 2 during update 1, still with them
    assert [lag for _, lag in tb_scalars(tmp_path, "train/policy_lag")] == [0, 1, 2]
    assert all(tb_scalars(tmp_path, f"train/{k}") for k in ("q_loss", "alpha", "q_mean", "replay_ratio", "entropy"))

    resumed = small_config(f"runner.run_dir={tmp_path}", "runner.total_env_steps=160", *sac_run)
    trainer = Trainer(resumed, tmp_path, resume_from=state)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert tb_scalars(tmp_path, "train/buffer_size")[-1] == (160, 160.0)
    assert tb_scalars(tmp_path, "train/gradient_steps")[-1] == (160, 60.0)
    assert tb_scalars(tmp_path, "train/policy_lag")[-1] == (160, 0.0)



def test_rollouts_act_uniformly_until_the_updates_start():
    _, sac = _sac("algorithm.sac.learning_starts=256")
    assert sac.uniform_actions(0) and sac.uniform_actions(255) and not sac.uniform_actions(256)
    assert not make_algorithm(compose([]).algorithm).uniform_actions(0)  # PPO
