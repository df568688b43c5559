"""The PPO loss on a batch small enough to check by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from embodied.algorithms.losses import LossTerms, kl_to_reference, ppo_loss

CFG = SimpleNamespace(clip_coef=0.2, clip_coef_high=None, clip_vloss=False, vf_coef=0.5, ent_coef=0.01)


def test_ppo_loss_hand_checked():
    # ratios: e^0 = 1, e^ln1.5 = 1.5 (clipped to 1.2 for A>0), e^ln0.5 = 0.5 (clipped to 0.8 for A<0)
    old = torch.zeros(3)
    new = torch.tensor([0.0, math.log(1.5), math.log(0.5)])
    adv = torch.tensor([1.0, 2.0, -1.0])
    # per-sample surrogate: max(-A r, -A clip(r)):
    #   s0: max(-1, -1) = -1;  s1: max(-3, -2.4) = -2.4;  s2: max(0.5, 0.8) = 0.8
    policy_loss = (-1.0 - 2.4 + 0.8) / 3
    new_v, ret = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 2.0, 5.0])
    value_loss = 0.5 * (1.0 + 0.0 + 4.0) / 3
    entropy = torch.tensor([1.0, 2.0, 3.0])
    loss, stats = ppo_loss(LossTerms(new, old, adv, new_v, new_v.clone(), ret, entropy), CFG)
    assert stats["policy_loss"] == pytest.approx(policy_loss)
    assert stats["value_loss"] == pytest.approx(value_loss)
    assert loss.item() == pytest.approx(policy_loss + 0.5 * value_loss - 0.01 * 2.0)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)


def test_clipped_sample_has_no_policy_gradient():
    """Past the clip range (in the direction the advantage favours) the gradient is zero."""
    new = torch.tensor([math.log(1.5)], requires_grad=True)
    loss, _ = ppo_loss(LossTerms(new, torch.zeros(1), torch.tensor([1.0]), torch.zeros(1), torch.zeros(1),
                                 torch.zeros(1), torch.zeros(1)), CFG)
    loss.backward()
    assert new.grad.abs().item() == 0.0


def test_value_clipping_limits_value_change():
    cfg = SimpleNamespace(**{**vars(CFG), "clip_vloss": True, "ent_coef": 0.0})
    old_v, new_v, ret = torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0])
    # unclipped error 0, clipped prediction 0.2 -> error 0.8^2; max takes the clipped one
    _, stats = ppo_loss(LossTerms(torch.zeros(1), torch.zeros(1), torch.zeros(1), new_v, old_v, ret, torch.zeros(1)),
                        cfg)
    assert stats["value_loss"] == pytest.approx(0.5 * 0.8**2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_to_reference_estimates_the_exact_kl_from_the_policys_samples(seed):
    """k3 on samples of p approaches KL(p || q) = sum p log(p/q); each sample's term is >= 0."""
    g = torch.Generator().manual_seed(seed)
    log_p = torch.randn(8, generator=g).log_softmax(0)
    log_q = torch.randn(8, generator=g).log_softmax(0)
    samples = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=g)
    exact = (log_p.exp() * (log_p - log_q)).sum()
    assert kl_to_reference(log_p[samples], log_q[samples]).item() == pytest.approx(exact.item(), rel=0.03)
    assert kl_to_reference(log_p[samples], log_p[samples]).item() == 0.0
    per_sample = [kl_to_reference(log_p[k:k + 1], log_q[k:k + 1]).item() for k in range(8)]
    assert min(per_sample) >= 0.0


def test_actor_checkpoint_keeps_the_kl_reference_and_a_warm_start_does_not_move_it():
    """A resumed run measures drift from its original starting weights, not from where it stopped."""
    from embodied.config import compose
    from embodied.workers.actor_worker import ActorWorker

    cfg = compose(["algorithm.kl_coef=0.1"])
    spec = {"state": ((7,), torch.float32)}

    def actor(seed: int) -> ActorWorker:
        return ActorWorker(cfg.policy, cfg.algorithm, spec, 3, seed=seed, rank=0, world_size=1)

    trained = actor(0)
    trained.freeze_reference()
    start = {k: v.clone() for k, v in trained.get_weights().items()}  # CPU: get_weights aliases
    with torch.no_grad():
        for param in trained.policy.parameters():
            param.add_(1.0)
    state = trained.state()
    resumed = actor(1)
    resumed.load_state(state)
    assert all(torch.equal(resumed.reference.state_dict()[k], start[k]) for k in start)
    assert all(torch.equal(resumed.get_weights()[k], state["policy"][k]) for k in start)
    best = actor(2)  # final_weights=best reloads weights only: the reference stays put
    best.freeze_reference()
    own_start = {k: v.clone() for k, v in best.get_weights().items()}
    best.load_state(state, weights_only=True)
    assert all(torch.equal(best.reference.state_dict()[k], own_start[k]) for k in start)
