"""GAE equals a plain per-env, per-step reference loop."""

import pytest
import torch

from embodied.algorithms.advantages import gae


def reference_gae(rewards, values, dones, next_value, gamma, lam):
    T, B = len(rewards), len(rewards[0])
    adv = [[0.0] * B for _ in range(T)]
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            following = next_value[b] if t == T - 1 else values[t + 1][b]
            not_done = 0.0 if dones[t][b] else 1.0
            delta = rewards[t][b] + gamma * following * not_done - values[t][b]
            running = delta + gamma * lam * not_done * running
            adv[t][b] = running
    return adv


DONE_PATTERNS = {
    "none": lambda T, B, g: torch.zeros(T, B, dtype=torch.bool),
    "all": lambda T, B, g: torch.ones(T, B, dtype=torch.bool),
    "last_step": lambda T, B, g: torch.arange(T)[:, None].expand(T, B) == T - 1,
    "first_step": lambda T, B, g: torch.arange(T)[:, None].expand(T, B) == 0,
    "random": lambda T, B, g: torch.rand(T, B, generator=g) < 0.2,
}


@pytest.mark.parametrize("gamma", [0.0, 0.8, 0.99, 1.0])
@pytest.mark.parametrize("lam", [0.0, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("pattern", sorted(DONE_PATTERNS))
def test_gae_matches_reference_loop(gamma, lam, pattern):
    g = torch.Generator().manual_seed(hash((gamma, lam, pattern)) % 2**31)
    T, B = 13, 5
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    values = torch.randn(T, B, generator=g, dtype=torch.float64)
    next_value = torch.randn(B, generator=g, dtype=torch.float64)
    dones = DONE_PATTERNS[pattern](T, B, g)
    adv, ret = gae(rewards, values, dones, next_value, gamma, lam)
    expected = torch.tensor(reference_gae(rewards.tolist(), values.tolist(), dones.tolist(),
                                          next_value.tolist(), gamma, lam), dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_gae_lambda_one_is_discounted_return_minus_value():
    """With lambda = 1 and no dones, returns are the bootstrapped discounted sums."""
    T, gamma = 6, 0.9
    rewards = torch.arange(1.0, T + 1)[:, None]
    values = torch.zeros(T, 1)
    next_value = torch.tensor([10.0])
    _, ret = gae(rewards, values, torch.zeros(T, 1, dtype=torch.bool), next_value, gamma, 1.0)
    expected0 = sum(gamma**t * (t + 1) for t in range(T)) + gamma**T * 10.0
    assert ret[0, 0].item() == pytest.approx(expected0)
