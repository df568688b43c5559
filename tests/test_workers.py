"""WorkerGroup fan-out and Channel ordering on a real Ray cluster."""

import cloudpickle
import pytest

import tests.test_workers as this_module
from scheduler.channel import Channel
from scheduler.cluster import cluster_devices
from scheduler.placement import make_plan
from scheduler.worker import Worker, WorkerGroup

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


def test_constructor_error_surfaces(ray_cluster, plan):
    with pytest.raises(Exception, match="offset"):
        WorkerGroup(EchoWorker, "env", plan)  # missing the offset argument


def test_channel_passes_small_items_by_value_and_large_by_reference(ray_cluster):
    import numpy as np

    from scheduler.channel import _INLINE_BYTES, InOrder

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
