"""Placement plans: device ranges, modes, validation errors (pure logic, no Ray)."""

import pytest

from embodied.config import PlacementConfig
from envs.common import UserError
from scheduler.placement import make_plan, parse_devices
from scheduler.runtime.plan import ClusterDevices, Device

TWO_CPUS = ClusterDevices.single_node("cpu", 2)


def test_parse_devices():
    assert parse_devices("0-2,5") == [0, 1, 2, 5]
    assert parse_devices("3") == [3]
    with pytest.raises(UserError, match="Bad device range"):
        parse_devices("2-0")


def test_plan_spreads_ranks_and_shares_devices():
    plan = make_plan(PlacementConfig(env_workers=2, env="0-1", rollout="0", actor="1"), TWO_CPUS, num_envs=8)
    env = plan.groups["env"]
    assert [env.device_of(r) for r in range(2)] == [0, 1]
    assert plan.ranks_per_device() == {0: 2, 1: 2}
    assert env.share(plan) == 0.5
    assert plan.shares_device("env", "actor") and not plan.shares_device("rollout", "actor")


def test_devices_are_numbered_across_nodes():
    cluster = ClusterDevices("gpu", [Device(0, "head", 0), Device(1, "head", 1), Device(2, "b", 0), Device(3, "b", 1)])
    plan = make_plan(PlacementConfig(mode="disaggregated", env_workers=2, env="2-3", rollout="0", actor="1",
                                     pipeline_stages=2), cluster, num_envs=8)
    assert [plan.device("env", r) for r in range(2)] == [Device(2, "b", 0), Device(3, "b", 1)]
    assert plan.same_node("rollout", "actor") and not plan.same_node("env", "rollout")
    assert plan.weight_sync == "shared_memory"  # auto: rollout and actor share the head node
    split = make_plan(PlacementConfig(mode="disaggregated", env_workers=1, env="0", rollout="1", actor="2"),
                      cluster, num_envs=8)
    assert split.weight_sync == "object_store"  # auto across nodes
    assert split.offload  # auto: on GPUs


def test_weight_sync_choices_that_cannot_work_are_rejected():
    cluster = ClusterDevices("gpu", [Device(0, "head", 0), Device(1, "b", 0)])
    with pytest.raises(UserError, match="weight_sync=object_store"):
        make_plan(PlacementConfig(mode="hybrid", env_workers=1, env="0", rollout="1", actor="0",
                                  weight_sync="shared_memory"), cluster, num_envs=8)
    with pytest.raises(UserError, match="take turns"):
        make_plan(PlacementConfig(env_workers=1, env="0", rollout="0", actor="0", weight_sync="broadcast"),
                  cluster, num_envs=8)


@pytest.mark.parametrize("mode, env, rollout, actor, stages", [
    ("colocated", "0-1", "0-1", "0-1", 1),
    ("colocated", "0-1", "0", "0", 1),
    ("hybrid", "0", "1", "0-1", 4),
    ("hybrid", "0", "1", "1", 2),
    ("disaggregated", "0", "1", "2", 2),
])
def test_valid_modes(mode, env, rollout, actor, stages):
    cluster = ClusterDevices.single_node("cpu", 3)
    plan = make_plan(PlacementConfig(mode=mode, env_workers=1, env=env, rollout=rollout, actor=actor,
                                     pipeline_stages=stages), cluster, num_envs=16)
    assert plan.mode == mode and plan.pipeline_stages == stages


@pytest.mark.parametrize("kwargs, num_envs, message", [
    (dict(env="0-3"), 8, "names cpu device"),
    (dict(env_workers=3), 8, "does not split evenly"),
    (dict(mode="hybrid", env="0", rollout="1", actor="1", env_workers=1, pipeline_stages=3), 8,
     "multiple of 3"),
    (dict(mode="pipelined"), 8, "not a placement mode"),
    (dict(rollout_workers=0), 8, "at least 1"),
    (dict(pipeline_stages=2), 8, "cannot overlap"),
    (dict(env="0", rollout="1", actor="0", env_workers=1), 8, "share no device"),
    (dict(mode="hybrid", env="0-1", rollout="1", actor="0", env_workers=1), 8, r"both use device\(s\) \[1\]"),
    (dict(mode="disaggregated", env="0", rollout="1", actor="1", env_workers=1), 8, "rollout and actor"),
])
def test_bad_placements_fail_with_a_fix(kwargs, num_envs, message):
    with pytest.raises(UserError, match=message):
        make_plan(PlacementConfig(**kwargs), TWO_CPUS, num_envs=num_envs)


def test_hybrid_needs_the_actor_to_share():
    with pytest.raises(UserError, match="mode=disaggregated"):
        make_plan(PlacementConfig(mode="hybrid", env="0", rollout="1", actor="2", env_workers=1),
                  ClusterDevices.single_node("cpu", 3), num_envs=8)


@pytest.mark.parametrize(("kind", "nodes", "threads", "expected"), [
    ("cpu", ["head"], 2, [2]),  # one rank: all of actor_threads
    ("cpu", ["head", "head"], 2, [1, 1]),  # two ranks on a node's cores: one thread each
    ("cpu", ["head", "head", "head", "head"], 2, [1, 1, 1, 1]),  # never below 1
    ("cpu", ["head", "head", "b"], 4, [2, 2, 4]),
    ("gpu", ["head", "head"], 4, [4, 4]),  # GPU ranks do not share a device
])
def test_actor_ranks_on_one_cpu_node_split_its_update_threads(kind, nodes, threads, expected):
    cluster = ClusterDevices(kind, [Device(i, node, i) for i, node in enumerate(nodes)])
    last = len(nodes) - 1
    placement = PlacementConfig(env=f"0-{last}", rollout=f"0-{last}", actor=f"0-{last}", actor_workers=len(nodes))
    plan = make_plan(placement, cluster, num_envs=12)
    assert plan.update_threads(threads) == expected
