"""Policies: registry, shapes, and the CNN on real ManiSkill camera observations."""

import pytest
import torch
from torch import nn

from embodied.config import compose
from envs.common import UserError
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


@pytest.mark.integration  # renders a ManiSkill scene
def test_each_policy_is_registered_by_the_module_the_registry_names():
    """The registry imports a policy's module when a run asks for it: the map must match the decorators."""
    import importlib

    from policies.base import POLICIES

    for name, module in POLICIES.modules.items():
        cls = POLICIES.get(name)
        assert cls.__module__ == module and getattr(importlib.import_module(module), cls.__name__) is cls, name
    assert set(POLICIES) == set(POLICIES.modules)  # every registered policy is in the map


@pytest.mark.integration  # a fresh interpreter: this one has imported everything
def test_an_mlp_run_imports_no_vla_family():
    """pi0's and the VLAs' modules pull in transformers: 2.6 s of each policy worker's start-up, and of
    every command's config check, for runs that never use them."""
    import subprocess
    import sys

    from tests.conftest import REPO

    families = ("policies.pi0.policy", "policies.vla.policy", "policies.vla.oft", "policies.vla.qwen_vl")
    script = (f"FAMILIES = {families}; import sys; from embodied.config import compose; "
              "from policies.registry import make_policy, check_policy_config; "
              "cfg = compose([]); check_policy_config(cfg.policy, 8); "
              "make_policy(cfg.policy, {'state': ((42,), 'float32')}, 8); "  # what a policy worker does
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft') or m in FAMILIES))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


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


def test_gaussian_token_head_acts_like_a_gaussian_policy_on_the_bins():
    """policy.net.token_head=gaussian: the greedy action is the bin nearest the mean, and sampled bins
    follow the Gaussian truncated to the [-1, 1] bins (std exp(log_std_init) = 0.61)."""
    policy = make_policy(compose(["policy=mlp_tokens"]).policy, STATE_SPEC, 8)
    with torch.no_grad():
        policy.actor.net[-1].bias.copy_(torch.linspace(-0.5, 0.5, 8))  # means away from 0, inside the box
    obs = {"state": torch.randn(4096, 35, generator=torch.Generator().manual_seed(0))}
    mean = policy.actor.net(obs["state"]).detach()
    greedy = policy.to_env(policy.act(obs, deterministic=True)[0])
    assert (greedy - mean).abs().max() <= policy.actions.bin_width / 2 + 1e-4  # float32 near-ties
    noise = torch.randn(4096, 8, generator=torch.Generator().manual_seed(1))
    sampled = policy.to_env(policy.act(obs, noise=noise)[0])
    std, normal = policy.actor.log_std.exp().detach(), torch.distributions.Normal(0.0, 1.0)
    low, high = (-1 - mean) / std, (1 - mean) / std
    density = normal.log_prob(low).exp() - normal.log_prob(high).exp()
    truncated_mean = mean + std * density / (normal.cdf(high) - normal.cdf(low))
    torch.testing.assert_close(sampled.mean(0), truncated_mean.mean(0), atol=0.03, rtol=0)
    assert 0.4 < float((sampled - truncated_mean).std()) < 0.61  # the box cuts the Gaussian's tails


def test_mlp_tokens_rejects_image_only_envs():
    cfg = compose(["policy=mlp_tokens"])
    with pytest.raises(UserError, match="obs_mode: state"):
        make_policy(cfg.policy, {"rgb": ((64, 64, 3), torch.uint8)}, 8)


@pytest.mark.parametrize("fn", [torch.log, torch.sigmoid, torch.sin, torch.special.ndtr], ids=lambda f: f.__name__)
@pytest.mark.parametrize("width", [1, 8, 13])
def test_rowwise_exact_gives_each_row_the_bits_of_the_whole_batch(fn, width):
    """A CPU kernel's scalar tail can differ from its vector loop in the last bit; rowwise_exact
    must not let a row's result depend on the batch it is computed in."""
    from policies.base import rowwise_exact

    x = torch.rand(300, width, generator=torch.Generator().manual_seed(0)) * 0.2 + 0.05
    whole = rowwise_exact(fn, x)
    torch.testing.assert_close(whole, fn(x))
    for size in (1, 2, 3, 7):
        pieces = torch.cat([rowwise_exact(fn, x[i:i + size]) for i in range(0, len(x), size)])
        assert torch.equal(pieces, whole), f"{fn.__name__} rows differ when computed {size} at a time"


PIECES = [(0, 1), (3, 1), (5, 7), (7, 33), (63, 65), (100, 200)]  # (start, length): inside and across tiles


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_features", [1, 8, 42, 256, 3136])
@pytest.mark.parametrize("out_features", [1, 2, 8, 17, 256])
def test_batch_invariant_linear_gives_each_row_the_bits_of_the_whole_batch(in_features, out_features, threads):
    """Any slice of the rows, wherever it starts, gets the bits the whole batch gives them (narrow layers too:
    without the added zero columns, a value head's rows changed in the last bit with their place)."""
    from policies.base import Linear

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(in_features * 1000 + out_features)
        layer = Linear(in_features, out_features, bias=out_features != 17)  # one shape without a bias
        layer.batch_invariant = True
        x = torch.randn(300, in_features, generator=g)
        with torch.no_grad():
            whole = layer(x)
            torch.testing.assert_close(whole, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            for start, length in PIECES:
                assert torch.equal(layer(x[start:start + length]), whole[start:start + length]), (start, length)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("channels, kernel, stride, size", [(3, 8, 4, 64), (32, 4, 2, 15), (64, 3, 1, 6)])
def test_batch_invariant_conv_gives_each_image_the_bits_of_the_whole_batch(channels, kernel, stride, size, threads):
    from policies.base import Conv2d

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        conv = Conv2d(channels, 32, kernel, stride)
        conv.batch_invariant = True
        x = torch.rand(120, channels, size, size, generator=torch.Generator().manual_seed(channels))
        with torch.no_grad():
            whole = conv(x)
            for start, length in [(0, 1), (3, 1), (5, 7), (7, 33), (60, 60)]:
                assert torch.equal(conv(x[start:start + length]), whole[start:start + length]), (start, length)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name, obs_spec", [
    ("mlp", {"state": ((42,), "float32")}),
    ("mlp_tokens", {"state": ((42,), "float32")}),
    ("mlp_flow", {"state": ((42,), "float32")}),
    ("mlp_flow policy.flow.method=noise", {"state": ((42,), "float32")}),
    ("mlp_sac", {"state": ((42,), "float32")}),
    ("cnn", {"rgb": ((64, 64, 3), "uint8"), "state": ((25,), "float32")}),
])
def test_batch_invariant_inference_matches_any_split(name, obs_spec):
    """A pipelined rollout infers on micro-batches: each row must come out as in the full batch."""
    from policies.base import set_batch_invariant

    cfg = compose(f"policy={name}".split()).policy
    policy = make_policy(cfg, obs_spec, 8)
    set_batch_invariant(policy)
    g = torch.Generator().manual_seed(0)
    n = 70  # the invariant paths work in tiles of 32 rows / 16 images: pieces cross their edges
    obs = {"state": torch.randn(n, obs_spec["state"][0][0], generator=g)}
    if "rgb" in obs_spec:
        obs["rgb"] = torch.randint(0, 256, (n, 64, 64, 3), dtype=torch.uint8, generator=g)
    noise = torch.randn(n, policy.noise_dim, generator=g)
    full = policy.act(obs, noise=noise)
    for size in (1, 3, 8, 33):
        parts = [policy.act({k: v[i:i + size] for k, v in obs.items()}, noise=noise[i:i + size])
                 for i in range(0, n, size)]
        for whole, pieces in zip(full, zip(*parts, strict=True), strict=True):
            torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=0)
    set_batch_invariant(policy, False)  # the fast path computes the same function
    for fast, invariant in zip(policy.act(obs, noise=noise), full, strict=True):
        torch.testing.assert_close(fast, invariant, rtol=1e-5, atol=1e-5)
