"""WorkerGroup fan-out and Channel ordering on a real Ray cluster."""

import os
import threading

import cloudpickle
import pytest

import tests.test_workers as this_module
from envs.common import UserError
from scheduler.placement import make_plan
from scheduler.runtime.channel import Channel
from scheduler.runtime.cluster import cluster_devices
from scheduler.runtime.worker import Worker, WorkerGroup

# Ray workers cannot import the tests package: ship this module's classes by value
cloudpickle.register_pickle_by_value(this_module)


class EchoWorker(Worker):
    def __init__(self, offset: int, **kwargs):
        super().__init__(**kwargs)
        self.offset = offset

    def whoami(self, x: int) -> tuple[int, int, int]:
        return self.rank, self.world_size, x + self.offset + self.rank

    def produce(self, channel: Channel, n: int) -> None:
        for i in range(n):
            channel.put((self.rank, i), key=("to", self.rank))

    def consume(self, channel: Channel, source: int, n: int) -> list:
        return [channel.get(key=("to", source), timeout=60) for _ in range(n)]

    def refuse(self) -> None:
        raise UserError("policy.vla.image_size=4: too small (bad input a worker found)")


class PinnedWorker(Worker):
    def affinities_around_all_cores(self) -> dict:
        """This thread's cores before, inside and after ``all_cores``, and those of a thread
        started inside it (as an update's thread pool is)."""
        started, stop = threading.Event(), threading.Event()
        before = os.sched_getaffinity(0)
        with self.all_cores():
            inside = os.sched_getaffinity(0)
            pool = threading.Thread(target=lambda: (started.set(), stop.wait()))
            pool.start()
            started.wait()
        after = os.sched_getaffinity(0)
        pool_after = os.sched_getaffinity(pool.native_id)
        stop.set()
        return {"node": self.node_cores, "pinned": self.pinned_core, "before": before, "inside": inside,
                "after": after, "pool_after": pool_after}


@pytest.fixture(scope="module")
def plan(ray_cluster):
    from embodied.config import PlacementConfig

    return make_plan(PlacementConfig(env_workers=3, env="0-1", rollout="0", actor="1"),
                     cluster_devices(), num_envs=3)


def test_group_call_fans_out_in_rank_order(ray_cluster, plan):
    group = WorkerGroup(EchoWorker, "env", plan, offset=100)
    try:
        assert group.call("whoami", 1) == [(0, 3, 101), (1, 3, 102), (2, 3, 103)]
        refs = group.call_async("whoami", per_rank_args=[(10,), (20,), (30,)])
        import ray

        assert [r[2] for r in ray.get(refs)] == [110, 121, 132]
    finally:
        group.shutdown()


def test_channel_keeps_order_per_key(ray_cluster, plan):
    import ray

    group = WorkerGroup(EchoWorker, "env", plan, offset=0)
    channel = Channel("test")
    try:
        # ranks 0 and 1 produce, rank 2 consumes both streams (interleaved puts)
        consumed = [group.workers[2].consume.remote(channel, src, 200) for src in (0, 1)]
        ray.get([group.workers[r].produce.remote(channel, 200) for r in (0, 1)])
        for src, items in enumerate(ray.get(consumed)):
            assert items == [(src, i) for i in range(200)]
        assert channel.qsize(("to", 0)) == 0
    finally:
        group.shutdown()


def test_pinned_worker_gets_every_core_only_inside_all_cores(ray_cluster):
    import ray

    worker = ray.remote(PinnedWorker).remote(rank=0, world_size=1, local_device=1, pin_cpu=True)
    try:
        seen = ray.get(worker.affinities_around_all_cores.remote())
    finally:
        ray.kill(worker)
    pinned = {seen["pinned"]}
    assert seen["before"] == pinned and seen["after"] == pinned
    assert seen["inside"] == seen["node"] == os.sched_getaffinity(0)
    assert seen["pool_after"] == pinned  # a thread started inside is pinned again on the way out


def test_constructor_error_surfaces(ray_cluster, plan):
    with pytest.raises(Exception, match="offset"):
        WorkerGroup(EchoWorker, "env", plan)  # missing the offset argument


def test_channel_passes_small_items_by_value_and_large_by_reference(ray_cluster):
    import numpy as np

    from scheduler.runtime.channel import _INLINE_BYTES, InOrder

    channel = Channel("sizes")
    small = {"actions": np.arange(8, dtype=np.float32)}
    large = {"rgb": np.random.default_rng(0).integers(0, 255, _INLINE_BYTES * 4, dtype=np.uint8)}
    keys = [("k", i % 2) for i in range(6)]
    incoming = InOrder(channel, keys)  # requests go out before the items exist
    for i, key in enumerate(keys):
        channel.put((i, small if i % 3 else large), key=key)
    for i in range(6):
        index, item = incoming.next()
        assert index == i
        expected = small if i % 3 else large
        assert all(np.array_equal(item[k], expected[k]) for k in expected)


def test_bad_input_a_worker_finds_is_a_user_error_not_a_fault_to_retry(ray_cluster, plan):
    """A UserError raised in a worker's call comes back as that UserError (the CLI's exit 2), never as
    a WorkerFailure, which the runner would answer by replacing workers and trying again."""
    from scheduler.runtime.faults import Deadlines, Watchdog, WorkerFailure

    watchdog = Watchdog(Deadlines(30.0, 5.0, 60.0))
    group = watchdog.watch(WorkerGroup(EchoWorker, "env", plan, offset=0, get=watchdog.get))
    try:
        with pytest.raises(UserError, match="policy.vla.image_size=4") as err:
            watchdog.get(group.call_async("refuse"), "refuse")
        assert not isinstance(err.value, WorkerFailure)
        assert group.call("whoami", 0)[0][0] == 0  # the workers are fine: nothing to replace
    finally:
        group.shutdown()
