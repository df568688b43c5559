"""Placement plans: device ranges, validation errors."""

import pytest

from embodied.config import PlacementConfig
from embodied.errors import UserError
from scheduler.placement import make_plan, parse_devices


def test_parse_devices():
    assert parse_devices("0-2,5") == [0, 1, 2, 5]
    assert parse_devices("3") == [3]
    with pytest.raises(UserError, match="Bad device range"):
        parse_devices("2-0")


def test_plan_spreads_ranks_and_shares_devices():
    plan = make_plan(PlacementConfig(env_workers=2, env="0-1", rollout="0", actor="1"),
                     num_gpus=0, num_cpus=2, num_envs=8)
    env = plan.groups["env"]
    assert [env.device_of(r) for r in range(2)] == [0, 1]
    assert plan.ranks_per_device() == {0: 2, 1: 2}
    assert env.share(plan) == 0.5


@pytest.mark.parametrize("kwargs, num_envs, message", [
    (dict(env="0-3"), 8, "names cpu device"),
    (dict(env_workers=3), 8, "does not split evenly"),
    (dict(mode="pipelined"), 8, "not available yet"),
    (dict(rollout_workers=0), 8, "at least 1"),
])
def test_bad_placements_fail_with_a_fix(kwargs, num_envs, message):
    with pytest.raises(UserError, match=message):
        make_plan(PlacementConfig(**kwargs), num_gpus=0, num_cpus=2, num_envs=num_envs)
