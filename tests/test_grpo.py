"""GRPO: group-relative outcome advantages equal a plain loop; the loss clips asymmetrically;
the update trains only on the samples an estimator marks valid."""

import math
from types import SimpleNamespace

import pytest
import torch

from embodied.algorithms.advantages import first_episode_mask, grpo_advantages
from embodied.algorithms.losses import LossTerms, ppo_loss
from embodied.algorithms.ppo import flatten_time
from envs.messages import Trajectory


def reference_grpo(rewards, dones, group_size, filter_uniform, weighting="step", eps=1e-6):
    """Per env: the return of its first episode; per group: mean and (unbiased) std;
    ``weighting="episode"``: each trained episode's advantage times mean length / its length."""
    T, B = len(rewards), len(rewards[0])
    outcome, length = [0.0] * B, [None] * B
    for b in range(B):
        for t in range(T):
            outcome[b] += rewards[t][b]
            if dones[t][b]:
                length[b] = t + 1
                break
    adv = [[0.0] * B for _ in range(T)]
    valid = [[False] * B for _ in range(T)]
    for g in range(B // group_size):
        members = list(range(g * group_size, (g + 1) * group_size))
        scores = [outcome[b] for b in members]
        mean = sum(scores) / group_size
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (group_size - 1))
        uniform = all(s == scores[0] for s in scores)
        for b in members:
            if length[b] is None or (filter_uniform and uniform):
                continue
            for t in range(length[b]):
                valid[t][b] = True
                adv[t][b] = (outcome[b] - mean) / (std + eps)
    if weighting == "episode":
        trained = [sum(valid[t][b] for t in range(T)) for b in range(B)]
        mean_length = sum(n for n in trained if n) / max(sum(1 for n in trained if n), 1)
        adv = [[a * mean_length / trained[b] if trained[b] else a for b, a in enumerate(row)] for row in adv]
    return adv, valid


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("filter_uniform", [False, True])
@pytest.mark.parametrize("weighting", ["episode", "step"])
@pytest.mark.parametrize("seed", range(4))
def test_grpo_matches_reference_loop(group_size, filter_uniform, weighting, seed):
    g = torch.Generator().manual_seed(seed)
    T, B = 9, 8
    dones = torch.rand(T, B, generator=g) < 0.25
    dones[:, -1] = False  # one env never finishes: it has no outcome and is not trained on
    # sparse success rewards, as LIBERO's: 1 at the step the episode succeeds
    rewards = (dones & (torch.rand(T, B, generator=g) < 0.5)).double()
    rewards[:, :group_size] = 0.0  # one group all failures: uniform
    adv, valid = grpo_advantages(rewards, dones, group_size, filter_uniform, weighting)
    ref_adv, ref_valid = reference_grpo(rewards.tolist(), dones.tolist(), group_size, filter_uniform, weighting)
    assert valid.tolist() == ref_valid
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=adv.dtype))
    if filter_uniform:
        assert not valid[:, :group_size].any()


def test_group_advantages_sum_to_zero_and_rank_outcomes():
    rewards = torch.zeros(4, 4)
    dones = torch.zeros(4, 4, dtype=torch.bool)
    dones[3] = True
    rewards[3] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # group 0: one success of two; group 1: none
    adv, valid = grpo_advantages(rewards, dones, group_size=2)
    assert adv[0, 0] > 0 > adv[0, 1] and adv[0, 0] == -adv[0, 1]
    assert (adv[:, 2:] == 0).all() and valid.all()


def test_episode_weighting_balances_a_group_whose_success_ended_early():
    """One success in 2 steps, one failure in 6: per step, the failure would weigh 3x as much
    and the summed advantage of the group's steps would be negative; per episode it is zero."""
    rewards, dones = torch.zeros(6, 2), torch.zeros(6, 2, dtype=torch.bool)
    dones[1, 0], rewards[1, 0], dones[5, 1] = True, 1.0, True
    by_step, valid = grpo_advantages(rewards, dones, group_size=2, weighting="step")
    by_episode, _ = grpo_advantages(rewards, dones, group_size=2, weighting="episode")
    assert by_step.sum() < 0 and by_episode.sum().abs() < 1e-6
    assert by_episode[0, 0] > 0 > by_episode[0, 1] and valid.sum() == 8
    assert by_episode[valid].abs().mean() == pytest.approx(by_step[valid].abs().mean(), rel=0.5)  # lr keeps its scale


def test_unknown_grpo_weighting_is_refused():
    from envs.common import UserError

    with pytest.raises(UserError, match="episode"):
        grpo_advantages(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), group_size=2, weighting="token")


def test_first_episode_mask_stops_after_the_first_done():
    dones = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], dtype=torch.bool)
    assert first_episode_mask(dones).tolist() == [[True, True], [True, False], [False, False], [False, False]]


def test_asymmetric_clip_allows_larger_increases():
    cfg = SimpleNamespace(clip_coef=0.2, clip_coef_high=0.28, clip_vloss=False, vf_coef=0.0, ent_coef=0.0)
    new = torch.tensor([math.log(1.25), math.log(1.25), math.log(0.75)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0])
    zeros = torch.zeros(3)
    loss, stats = ppo_loss(LossTerms(new, zeros, adv, zeros, zeros, zeros, zeros), cfg)
    loss.backward()
    # ratio 1.25 with A > 0: inside [0.8, 1.28], so it still gets a gradient (a symmetric 0.2 clip cuts it);
    # ratio 0.75 with A < 0: below 0.8, clipped, no gradient
    assert new.grad[0] != 0 and new.grad[2] == 0
    assert stats["clip_fraction"] == pytest.approx(1 / 3)


def test_update_trains_only_on_valid_samples():
    T, B = 3, 2
    batch = Trajectory(obs={"state": torch.arange(T * B * 2.0).view(T, B, 2)}, actions=torch.zeros(T, B, 1),
                       logprobs=torch.zeros(T, B), values=torch.zeros(T, B), rewards=torch.zeros(T, B),
                       dones=torch.zeros(T, B, dtype=torch.bool), next_value=torch.zeros(B))
    valid = torch.tensor([[True, False], [True, True], [False, False]])
    flat = flatten_time(batch, torch.ones(T, B), torch.zeros(T, B), valid)
    assert flat.obs["state"][:, 0].tolist() == [0.0, 4.0, 6.0]  # samples (0,0), (1,0), (1,1)
    assert flat.advantages.shape == (3,)
