"""What a rollout worker keeps of each step, as the algorithm's Collection asks
(embodied/workers/recorder.py), and the Trajectory fields an off-policy critic needs."""

import pytest
import torch

from embodied.algorithms.base import Collection
from embodied.algorithms.registry import make_algorithm
from embodied.config import AlgorithmConfig
from embodied.workers.recorder import TrajectoryRecorder
from envs.messages import StepMessage, Trajectory

B, T = 4, 3


def value_of(obs):
    return obs["state"].sum(-1)


def _episode_messages(seed: int = 0) -> list[StepMessage]:
    """``T + 1`` messages: env 0 terminates at step 1, env 1 is cut by its time limit at step 2,
    env 2 both at step 3 (a terminal state on the last step), env 3 runs on."""
    g = torch.Generator().manual_seed(seed)
    msgs = [StepMessage({"state": torch.randn(B, 2, generator=g)})]
    ends = {1: (0, None), 2: (None, 1), 3: (2, 2)}
    for t in range(1, T + 1):
        terminated, truncated = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
        term, trunc = ends[t]
        if term is not None:
            terminated[term] = True
        if trunc is not None:
            truncated[trunc] = True
        done = terminated | truncated
        final = {"state": torch.randn(B, 2, generator=g) * done[:, None]} if done.any() else None
        msgs.append(StepMessage({"state": torch.randn(B, 2, generator=g)}, torch.randn(B, generator=g),
                                terminated, truncated, final))
    return msgs


def _record(collection: Collection, msgs: list[StepMessage]) -> Trajectory:
    recorder = TrajectoryRecorder(collection, value_of)
    for t, msg in enumerate(msgs):
        if t > 0:
            recorder.outcome(msg)
        if t == len(msgs) - 1:
            return recorder.finish(msg.obs)
        recorder.decision(msg.obs, torch.full((B, 1), float(t)), torch.zeros(B), value_of(msg.obs))


def test_next_observations_are_the_following_step_or_the_episodes_final_one():
    msgs = _episode_messages()
    traj = _record(Collection(next_obs=True), msgs)
    assert traj.next_obs["state"].shape == (T, B, 2) and traj.terminated.shape == (T, B)
    for t in range(T):
        msg = msgs[t + 1]
        for env in range(B):
            want = msg.final_obs["state"][env] if bool(msg.done[env]) else msg.obs["state"][env]
            assert torch.equal(traj.next_obs["state"][t, env], want), (t, env)
        assert torch.equal(traj.obs["state"][t], msgs[t].obs["state"])
        assert torch.equal(traj.rewards[t], msg.reward)  # as the env gave them: the critic bootstraps itself
        assert torch.equal(traj.terminated[t], msg.terminated)
        assert torch.equal(traj.dones[t], msg.terminated | msg.truncated)
    assert torch.equal(traj.next_value, value_of(msgs[-1].obs))


@pytest.mark.parametrize("bootstrap, cut_envs", [("all_ends", {1: [0], 2: [1], 3: [2]}),
                                                 ("time_limit", {1: [], 2: [1], 3: []}),
                                                 ("none", {1: [], 2: [], 3: []})])
def test_rewards_bootstrap_the_cut_episodes_the_rule_names(bootstrap, cut_envs):
    msgs = _episode_messages(1)
    traj = _record(Collection(bootstrap=bootstrap, gamma=0.5), msgs)
    assert traj.next_obs is None and traj.terminated is None
    for t in range(1, T + 1):
        want = msgs[t].reward.clone()
        for env in cut_envs[t]:
            want[env] += 0.5 * value_of(msgs[t].final_obs)[env]
        assert torch.equal(traj.rewards[t - 1], want), t


def test_a_collection_with_next_observations_leaves_bootstrapping_to_the_critic():
    with pytest.raises(ValueError, match="bootstrap must be 'none'"):
        Collection(bootstrap="all_ends", next_obs=True)


@pytest.mark.parametrize("next_obs", [False, True])
def test_trajectories_join_split_and_move_with_their_optional_fields(next_obs):
    a = _record(Collection(next_obs=next_obs), _episode_messages(2))
    b = _record(Collection(next_obs=next_obs), _episode_messages(3))
    joined = Trajectory.concat([a, b])
    assert joined.num_envs == 2 * B
    back = joined.envs(slice(B, 2 * B))
    for name in ("actions", "rewards", "dones"):
        assert torch.equal(getattr(back, name), getattr(b, name)), name
    if next_obs:
        assert torch.equal(back.next_obs["state"], b.next_obs["state"])
        assert torch.equal(back.terminated, b.terminated)
    else:
        assert back.next_obs is None and back.terminated is None
    assert joined.map(lambda x: x, obs=False).next_obs is None


def test_ppo_and_grpo_keep_steps_as_on_policy_critics_want():
    cfg = AlgorithmConfig(bootstrap="time_limit", gamma=0.9)
    assert make_algorithm(cfg).collection == Collection(bootstrap="time_limit", gamma=0.9, next_obs=False)
    assert make_algorithm(cfg).state_dict() == {}  # PPO's training state is the policy and its optimizer
