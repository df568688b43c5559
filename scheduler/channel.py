"""Channel: a FIFO between worker groups, keyed so micro-batches route to the right peer.

Items put under one key come out of ``get(key)`` in the order they were put (Ray
runs one caller's calls to an actor in submission order). ``put`` does not wait;
``get`` blocks until an item is there.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any


class _ChannelStore:
    """The Ray actor behind a Channel: one asyncio queue per key."""

    def __init__(self):
        self.queues: dict[Any, asyncio.Queue] = defaultdict(asyncio.Queue)

    async def put(self, key: Any, item: Any) -> None:
        self.queues[key].put_nowait(item)

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
        self._store = ray.remote(_ChannelStore).options(num_cpus=0, max_concurrency=1024).remote()

    def put(self, item: Any, key: Any = "default") -> None:
        self._store.put.remote(key, item)

    def get(self, key: Any = "default", timeout: float | None = None) -> Any:
        import ray

        return ray.get(self._store.get.remote(key), timeout=timeout)

    def qsize(self, key: Any = "default") -> int:
        import ray

        return ray.get(self._store.qsize.remote(key))
