"""Action chunks: ChunkedVecEnv against real ManiSkill3 PushCube-v1 (physx_cpu), SFT chunk
targets, and PPO ratios per log-prob unit."""

import dataclasses

import pytest
import torch

from embodied.algorithms.losses import LossTerms, ppo_loss
from embodied.algorithms.sft import chunk_targets
from embodied.config import compose
from envs.chunking import ChunkedVecEnv
from envs.registry import make_vec_env
from tests.conftest import small_config

pytestmark = pytest.mark.integration  # ManiSkill envs in this process: not the fast tier

CHUNK = 3


@pytest.fixture(scope="module")
def twins():
    """Two identical 2-env PushCube batches with 7-step episodes (not a multiple of the chunk)."""
    cfg = dataclasses.replace(small_config().env, max_episode_steps=7)
    plain, chunked = (make_vec_env(cfg, num_envs=2, num_procs=0) for _ in range(2))
    yield plain, ChunkedVecEnv(chunked, CHUNK)
    plain.close()
    chunked.close()


def test_a_chunk_is_its_steps_in_order_until_the_episode_ends(twins):
    plain, chunked = twins
    assert chunked.max_episode_steps == 3  # ceil(7 / 3) decisions
    plain.reset(seed=[5, 6])
    chunked.reset(seed=[5, 6])
    actions = torch.rand(3, 2, CHUNK, plain.action_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for decision in range(3):
        steps = [plain.step(actions[decision, :, j]) for j in range(CHUNK)]
        result = chunked.step(actions[decision])
        torch.testing.assert_close(result.obs["state"], steps[-1].obs["state"])
        if decision < 2:  # 6 steps in: no episode has ended
            torch.testing.assert_close(result.reward, sum(s.reward for s in steps))
            assert not bool(result.done.any())
            continue
        # step 7 (the chunk's first) ends the episode at the time limit; the rest play in the next one
        assert bool(result.truncated.all()) and bool(steps[0].truncated.all())
        torch.testing.assert_close(result.reward, steps[0].reward)
        torch.testing.assert_close(result.info["final_obs"]["state"], steps[0].info["final_obs"]["state"])
        assert result.info["episode"]["length"].tolist() == [7, 7]
        torch.testing.assert_close(result.info["episode"]["return"], steps[0].info["episode"]["return"])


def test_unobserved_inner_steps_change_nothing_but_the_renders():
    """RGB PushCube: a chunk renders its cameras once, at its last step (or where an episode ends
    inside it), yet its observations, rewards, flags and final observations are those of
    stepping and rendering every step. 5-step episodes end inside the second chunk."""
    cfg = dataclasses.replace(compose(["env=maniskill_pushcube_rgb"]).env, image_size=32, max_episode_steps=5)
    plain, inner = (make_vec_env(cfg, num_envs=2, num_procs=0) for _ in range(2))
    chunked = ChunkedVecEnv(inner, CHUNK)
    try:
        plain.reset(seed=[3, 4])
        chunked.reset(seed=[3, 4])
        actions = torch.rand(3, 2, CHUNK, plain.action_dim, generator=torch.Generator().manual_seed(1)) * 2 - 1
        ends = 0
        for decision in range(3):
            steps = [plain.step(actions[decision, :, j]) for j in range(CHUNK)]
            result = chunked.step(actions[decision])
            assert [bool(s.obs) for s in result.info["steps"]] == [False] * (CHUNK - 1) + [True]
            for key in ("rgb", "state"):
                torch.testing.assert_close(result.obs[key], steps[-1].obs[key])
            for got, want in zip(result.info["steps"], steps, strict=True):
                torch.testing.assert_close(got.reward, want.reward)
                assert torch.equal(got.terminated, want.terminated) and torch.equal(got.truncated, want.truncated)
                assert torch.equal(got.info["success"], want.info["success"])
                if bool(want.done.any()):  # the episode's last step is rendered, inside the chunk or not
                    ends += 1
                    torch.testing.assert_close(got.info["final_obs"]["rgb"], want.info["final_obs"]["rgb"])
        assert ends == 1  # step 5: the second chunk's middle step
        chunked.observe_every_step = True  # what a video needs
        result = chunked.step(actions[0])
        assert all(s.obs["rgb"].shape == (2, 32, 32, 3) for s in result.info["steps"])
    finally:
        plain.close()
        chunked.close()


def test_chunked_actions_must_have_the_chunk_shape(twins):
    _, chunked = twins
    with pytest.raises(ValueError, match=r"\[B, 3, A\]"):
        chunked.step(torch.zeros(2, chunked.action_dim))


def test_sft_chunk_targets_are_the_next_actions_of_the_same_demo():
    actions = torch.arange(5.0)[:, None].repeat(1, 2)  # action t = [t, t]
    episode = torch.tensor([0, 0, 0, 1, 1])
    targets = chunk_targets(actions, episode, 3)
    assert targets.shape == (5, 3, 2)
    assert targets[:, :, 0].tolist() == [[0, 1, 2], [1, 2, 2], [2, 2, 2], [3, 4, 4], [4, 4, 4]]


def test_ppo_units_share_their_sample_advantage():
    """One ratio per unit: [N, 1] units give the [N] loss; units are clipped one by one."""
    cfg = compose([]).algorithm
    g = torch.Generator().manual_seed(0)
    old, adv = torch.randn(8, 3, generator=g), torch.randn(8, generator=g)
    new = old + 0.5 * torch.randn(8, 3, generator=g)
    value, ret, entropy = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    whole, _ = ppo_loss(LossTerms(new.sum(-1), old.sum(-1), adv, value, value, ret, entropy), cfg)
    whole_units, _ = ppo_loss(LossTerms(new.sum(-1, keepdim=True), old.sum(-1, keepdim=True), adv, value, value, ret,
                                        entropy), cfg)
    torch.testing.assert_close(whole, whole_units)
    per_unit, _ = ppo_loss(LossTerms(new, old, adv, value, value, ret, entropy), cfg)
    ratio = (new - old).exp()
    clipped = ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
    expected = torch.max(-adv[:, None] * ratio, -adv[:, None] * clipped).mean()
    torch.testing.assert_close(per_unit, expected)


def test_only_vla_policies_take_chunks():
    from envs.common import UserError
    from policies.registry import check_policy_config

    check_policy_config(compose(["policy=openvla_tiny", "policy.chunk_size=2"]).policy)
    with pytest.raises(UserError, match="chunk_size=2 is not possible for policy=mlp"):
        check_policy_config(compose(["policy=openvla_tiny", "policy.name=mlp", "policy.chunk_size=2"]).policy)
