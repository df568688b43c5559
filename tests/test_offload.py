"""Context switching: an offload/onload round trip is bit-exact and frees the device state."""

import copy

import pytest
import torch

from embodied.policy_config import NetConfig, PolicyConfig
from policies.registry import make_policy
from scheduler.runtime.offload import DeviceState
from tests.conftest import assert_identical

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _trained_policy(device: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = PolicyConfig(net=NetConfig(hidden_sizes=[64, 64]))
    policy = make_policy(cfg, {"state": ((10,), "float32")}, 3).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    _adam_step(policy, optimizer, seed)
    return policy, optimizer


def _adam_step(policy, optimizer, seed: int):
    g = torch.Generator().manual_seed(seed)
    device = next(policy.parameters()).device
    obs = {"state": torch.randn(32, 10, generator=g).to(device)}
    actions = torch.randn(32, 3, generator=g).to(device)
    logprob, entropy, value = policy.evaluate(obs, actions)
    optimizer.zero_grad()
    (-(logprob.mean()) + value.pow(2).mean()).backward()
    optimizer.step()


def _snapshot(policy, optimizer) -> dict:
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return {"params": copy.deepcopy(policy.state_dict()), "grads": grads,
            "optimizer": copy.deepcopy(optimizer.state_dict())}


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_bit_exact_and_frees_state(device):
    policy, optimizer = _trained_policy(device)
    before = _snapshot(policy, optimizer)
    state = DeviceState(policy, optimizer)
    held = state.resident_bytes()
    report = state.offload()
    assert report.bytes_moved == held > 0
    assert state.resident_bytes() == 0  # parameters, grads and Adam moments all gone
    assert all(p.numel() == 0 and p.grad is None for p in policy.parameters())
    state.onload()
    assert_identical(_snapshot(policy, optimizer), before)


@pytest.mark.parametrize("device", DEVICES)
def test_training_continues_identically_after_a_round_trip(device):
    policy_a, opt_a = _trained_policy(device)
    policy_b, opt_b = _trained_policy(device)
    state = DeviceState(policy_b, opt_b)
    for _ in range(3):
        state.offload()
        state.onload()
    for seed in (1, 2):
        _adam_step(policy_a, opt_a, seed)
        _adam_step(policy_b, opt_b, seed)
    assert_identical(_snapshot(policy_b, opt_b), _snapshot(policy_a, opt_a))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_frees_device_memory():
    torch.manual_seed(0)
    cfg = PolicyConfig(net=NetConfig(hidden_sizes=[1024, 1024]))
    policy = make_policy(cfg, {"state": ((256,), "float32")}, 8).cuda()
    optimizer = torch.optim.Adam(policy.parameters())
    _adam_step_big = torch.randn(64, 256, device="cuda")
    policy.value({"state": _adam_step_big}).sum().backward()
    optimizer.step()
    state = DeviceState(policy, optimizer)
    report = state.offload()
    freed = report.device_bytes_before - report.device_bytes_after
    print(f"device memory before offload {report.device_bytes_before / 2**20:.1f} MiB, "
          f"after {report.device_bytes_after / 2**20:.1f} MiB, freed {freed / 2**20:.1f} MiB")
    assert freed >= 0.9 * report.bytes_moved
    state.onload()
