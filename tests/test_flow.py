"""Flow-matching policies (policies/flow_steps.py, flow_policy.py, mlp_flow.py): the step formulas on
hand-computed cases, chains re-scored exactly, evaluation as plain Euler integration, seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from embodied.config import compose
from envs.common import UserError
from policies.flow_steps import gaussian_logprob, ode_mean, sde_sigma, sde_step, time_grid
from policies.registry import check_policy_config, make_policy

STATE, ACTIONS = 10, 4
METHODS = ["sde", "noise"]


def _policy(*overrides: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = compose(["policy=mlp_flow", "policy.net.hidden_sizes=[32,32]", *overrides]).policy
    check_policy_config(cfg, ACTIONS)
    return make_policy(cfg, {"state": ((STATE,), "float32")}, ACTIONS)


def _obs(n: int = 6, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(n, STATE, generator=torch.Generator().manual_seed(seed))}


# -- the step formulas ---------------------------------------------------------------------
def test_the_time_grid_runs_from_noise_to_the_action():
    assert time_grid(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("steps", range(1, 51))
def test_the_time_grid_is_the_references_to_the_bit(steps):
    """lerobot's and openpi's PyTorch samplers (``euler_integrate``): ``dt = -1.0 / num_steps`` and
    ``time = 1.0 + step * dt`` in Python floats, each made a float32 tensor. A float32 ``1 - k / K`` is one
    ulp off for K = 3, 5, 6, 7, 9, 10, ...: this compares every bit."""
    dt = -1.0 / steps
    reference = [torch.tensor(1.0 + k * dt, dtype=torch.float32) for k in range(steps)]
    grid = time_grid(steps)
    assert grid.dtype == torch.float32 and len(grid) == steps + 1 and grid[-1] == 0
    assert torch.equal(grid[:-1], torch.stack(reference))


@pytest.mark.parametrize("x, v, t, delta, a, mean, std", [
    # t = 0.5, delta = 0.25, a = 0.5: sigma = 0.5; x0_hat = 1 - 0.5 * 2 = 0, x1_hat = 1 + 0.5 * 2 = 2;
    # mean = 0.75 * 0 + (0.25 - 0.25 * 0.25 / 1) * 2 = 0.375; std = 0.5 * 0.5 = 0.25
    (1.0, 2.0, 0.5, 0.25, 0.5, 0.375, 0.25),
    # t = 1 takes sigma at t - delta = 0.75: sigma = 0.3 * sqrt(3); x0_hat = 0.5 - 1 = -0.5, x1_hat = 0.5;
    # mean = 0.25 * -0.5 + (0.75 - 0.27 * 0.25 / 2) * 0.5 = -0.125 + 0.358125 = 0.233125; std = 0.5 * sigma
    (0.5, 1.0, 1.0, 0.25, 0.3, 0.233125, 0.5 * 0.3 * math.sqrt(3)),
    # t = 0.25, the last step of 4: sigma = 0.4 / sqrt(3); x0_hat = -1 + 0.25 * 4 = 0, x1_hat = -1 - 0.75 * 4 = -4;
    # mean = 1 * 0 + (0 - (0.16 / 3) * 0.25 / 0.5) * -4 = 0.10666..; std = 0.5 * sigma
    (-1.0, -4.0, 0.25, 0.25, 0.4, 0.16 / 3 * 0.5 * 4, 0.5 * 0.4 / math.sqrt(3)),
])
def test_a_flow_sde_step_has_the_published_mean_and_std(x, v, t, delta, a, mean, std):
    got_mean, got_std = sde_step(torch.tensor([x]), torch.tensor([v]), torch.tensor([t]), delta, a)
    assert got_mean.item() == pytest.approx(mean, abs=1e-6)
    assert got_std.item() == pytest.approx(std, abs=1e-6)


def test_flow_sde_without_noise_is_the_ode():
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    for t in time_grid(5)[:-1]:
        mean, std = sde_step(x, v, t.expand(3, 1), 0.2, 0.0)
        torch.testing.assert_close(mean, ode_mean(x, v, 0.2), rtol=0, atol=1e-6)
        assert float(std.abs().max()) == 0.0
    assert sde_sigma(torch.tensor(1.0), 0.25, 0.5).isfinite()


def test_the_flow_sde_chain_with_noise_level_zero_is_the_ode_chain():
    policy = _policy("policy.flow.noise_level=1e-30")
    obs, noise = _obs(), torch.randn(6, policy.noise_dim)
    features, _ = policy.heads(obs)
    chain, _ = policy.unpack(policy.act(obs, noise=noise)[0])
    torch.testing.assert_close(chain, policy.ode_chain(features, noise[:, :policy.width], policy.steps),
                               rtol=0, atol=1e-6)


def test_gaussian_logprob_is_torchs():
    x, mean, std = torch.randn(7), torch.randn(7), torch.rand(7) + 0.1
    torch.testing.assert_close(gaussian_logprob(x, mean, std), torch.distributions.Normal(mean, std).log_prob(x))


# -- the policy ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_stored_chain_is_rescored_to_the_rollouts_log_prob(method, chunk):
    policy = _policy(f"policy.flow.method={method}", f"policy.chunk_size={chunk}")
    obs = _obs()
    actions, logprob, value = policy.act(obs)
    d = chunk * ACTIONS
    assert actions.shape == (6, (policy.steps + 1) * d + 1) and logprob.shape == (6, d) and value.shape == (6,)
    again, entropy, value_again = policy.evaluate(obs, actions)
    torch.testing.assert_close(again, logprob, rtol=0, atol=1e-6)
    torch.testing.assert_close(value_again, value, rtol=0, atol=1e-6)
    assert entropy.shape == (6,) and entropy.isfinite().all()
    assert policy.to_env(actions).shape == ((6, chunk, ACTIONS) if chunk > 1 else (6, ACTIONS))


def test_flow_sde_has_one_stochastic_step_drawn_per_sample_or_the_configured_one():
    policy = _policy()
    actions, logprob, _ = policy.act(_obs(256), noise=torch.randn(256, policy.noise_dim))
    chain, step = policy.unpack(actions)
    assert set(step.long().tolist()) == set(range(policy.steps))  # every step is drawn
    features, _ = policy.heads(_obs(256))
    ode = policy.ode_chain(features, chain[:, 0], policy.steps)
    rows = torch.arange(256)
    torch.testing.assert_close(chain[rows, step.long()], ode[rows, step.long()], rtol=0, atol=1e-5)  # ODE up to it
    fixed = _policy("policy.flow.sde_step=2")
    assert set(fixed.unpack(fixed.act(_obs())[0])[1].tolist()) == {2.0}


def test_flow_noise_log_prob_is_the_mean_of_the_chains_log_densities():
    policy = _policy("policy.flow.method=noise")
    obs = _obs()
    actions, logprob, _ = policy.act(obs)
    chain, _ = policy.unpack(actions)
    features, _ = policy.heads(obs)
    terms = [gaussian_logprob(chain[:, 0], torch.zeros(1), torch.ones(1))]
    for k, t in enumerate(time_grid(policy.steps)[:-1]):
        tt = t.expand(6)
        std = policy.noise_std(features, chain[:, k], tt)
        assert float(std.min()) >= 0.08 and float(std.max()) <= 0.16
        mean = ode_mean(chain[:, k], policy.velocity(features, chain[:, k], tt), 1 / policy.steps)
        terms.append(gaussian_logprob(chain[:, k + 1], mean, std))
    torch.testing.assert_close(logprob, torch.stack(terms).mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("eval_steps", [None, 10])
def test_evaluation_is_plain_euler_integration_and_deterministic(eval_steps):
    policy = _policy(*([f"policy.flow.eval_steps={eval_steps}"] if eval_steps else []))
    obs, noise = _obs(), torch.randn(6, policy.noise_dim)
    actions, logprob, _ = policy.act(obs, deterministic=True, noise=noise)
    steps = eval_steps or policy.steps
    x = noise[:, :policy.width]
    features, _ = policy.heads(obs)
    for k in range(steps):  # Euler by hand
        x = x - (1 / steps) * policy.velocity(features, x, torch.full((6,), 1 - k / steps))
    chain, _ = policy.unpack(actions)
    assert chain.shape[1] == steps + 1
    torch.testing.assert_close(chain[:, -1], x, rtol=0, atol=1e-6)
    torch.testing.assert_close(policy.to_env(actions), x.clamp(-1, 1), rtol=0, atol=1e-6)
    assert torch.equal(policy.act(obs, deterministic=True, noise=noise)[0], actions)
    assert float(logprob.abs().max()) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_sampling_depends_only_on_the_callers_noise(method):
    """What makes pipelined rollouts equal serial ones, and a redone iteration sample as before."""
    policy = _policy(f"policy.flow.method={method}")
    obs, noise = _obs(8), torch.randn(8, policy.noise_dim)
    whole = policy.act(obs, noise=noise)[0]
    halves = torch.cat([policy.act({"state": obs["state"][i:i + 4]}, noise=noise[i:i + 4])[0] for i in (0, 4)])
    torch.testing.assert_close(halves, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_the_ppo_ratio_is_one_on_the_first_minibatch(method):
    from embodied.algorithms.logprob_levels import group_logprobs

    policy = _policy(f"policy.flow.method={method}")
    obs = _obs(16)
    actions, old, _ = policy.act(obs)
    new, _, _ = policy.evaluate(obs, actions)
    for level in ("token", "action", "chunk"):
        ratio = (group_logprobs(new, level, ACTIONS) - group_logprobs(old, level, ACTIONS)).exp()
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_reach_the_velocity_net_through_the_log_prob(method):
    policy = _policy(f"policy.flow.method={method}")
    obs = _obs()
    actions, _, _ = policy.act(obs)
    logprob, entropy, value = policy.evaluate(obs, actions)
    (logprob.sum() + value.sum()).backward()
    assert float(policy.velocity_net[0].weight.grad.abs().sum()) > 0
    assert float(policy.critic[0].weight.grad.abs().sum()) > 0
    if method == "noise":
        assert float(policy.noise_net[0].weight.grad.abs().sum()) > 0


def test_expert_only_training_freezes_the_trunk():
    policy = _policy("policy.flow.train=expert")
    assert not any(p.requires_grad for p in policy.trunk.parameters())
    assert all(p.requires_grad for p in policy.velocity_net.parameters())


def test_the_flow_matching_loss_fits_demo_actions():
    """SFT on a fixed state -> action map: the ODE then lands on the demo's action from any noise."""
    policy = _policy()
    obs = _obs(32)
    targets = torch.tanh(obs["state"][:, :ACTIONS])[:, None]  # [B, 1, A], inside [-1, 1]
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(600):
        loss = policy.demo_loss(obs, targets)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        acted = policy.to_env(policy.act(obs, deterministic=True, noise=torch.randn(32, policy.noise_dim))[0])
    assert float((acted - targets[:, 0]).abs().mean()) < 0.1


@pytest.mark.parametrize("overrides, words", [
    (["policy.flow.method=ddim"], ["policy.flow.method", "sde", "noise"]),
    (["policy.flow.sde_step=4"], ["policy.flow.sde_step=4", "0 .. 3"]),
    (["policy.flow.train=trunk"], ["policy.flow.train=trunk", "expert"]),
    (["policy.flow.noise_min=0.2"], ["noise_min=0.2", "noise_max"]),
])
def test_bad_flow_settings_are_refused_before_workers_start(overrides, words):
    with pytest.raises(UserError) as err:
        _policy(*overrides)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_flow_keys_are_refused_for_a_policy_without_a_flow_head():
    with pytest.raises(UserError, match=r"policy.flow.steps=8: policy=mlp reads policy.net"):
        check_policy_config(compose(["policy=mlp", "policy.flow.steps=8"]).policy, ACTIONS)
