"""Channel: a FIFO between worker groups, keyed so micro-batches route to the right peer.

Items one process puts under a key come out of ``get(key)`` in the order it put
them. ``put`` does not wait; ``get`` blocks until an item is there. Items travel
through Ray's object store; the channel actor only queues their references, so it
costs next to no CPU however large the items (camera images) are.

Ray does not promise to run one caller's calls to a concurrent (async) actor in
submission order, so every put carries its producer's id and a sequence number,
and the store releases each producer's items in sequence.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from typing import Any

# every process that puts is one producer; its sequence numbers live here, per channel and key,
# so copies of a Channel passed to the same process in several calls share one sequence
_PRODUCER = uuid.uuid4().hex
_NEXT_SEQ: dict[tuple[str, Any], int] = defaultdict(int)


class _ChannelStore:
    """The Ray actor behind a Channel: one asyncio queue per key."""

    def __init__(self):
        self.queues: dict[Any, asyncio.Queue] = defaultdict(asyncio.Queue)
        self.next_seq: dict[tuple, int] = defaultdict(int)  # (key, producer) -> next to release
        self.pending: dict[tuple, dict[int, Any]] = defaultdict(dict)  # items that arrived early

    async def put(self, key: Any, item: Any, producer: str, seq: int) -> None:
        stream = (key, producer)
        self.pending[stream][seq] = item
        while self.next_seq[stream] in self.pending[stream]:
            self.queues[key].put_nowait(self.pending[stream].pop(self.next_seq[stream]))
            self.next_seq[stream] += 1

    async def get(self, key: Any) -> Any:
        return await self.queues[key].get()

    async def qsize(self, key: Any) -> int:
        return self.queues[key].qsize()


class Channel:
    """A keyed FIFO shared by Ray workers (pass the Channel object to them)."""

    def __init__(self, name: str = "channel"):
        import ray

        self.name = name
        # zero CPU: it only moves references, and must not block worker placement
        self.id = uuid.uuid4().hex
        self._store = ray.remote(_ChannelStore).options(num_cpus=0, max_concurrency=1024).remote()

    def put(self, item: Any, key: Any = "default") -> None:
        import ray

        stream = (self.id, key)
        seq = _NEXT_SEQ[stream]
        _NEXT_SEQ[stream] = seq + 1
        # a reference inside a list is passed as is (Ray resolves only top-level arguments)
        self._store.put.remote(key, [ray.put(item)], _PRODUCER, seq)

    def get(self, key: Any = "default", timeout: float | None = None) -> Any:
        import ray

        (ref,) = ray.get(self._store.get.remote(key), timeout=timeout)
        return ray.get(ref, timeout=timeout)

    def qsize(self, key: Any = "default") -> int:
        import ray

        return ray.get(self._store.qsize.remote(key))
