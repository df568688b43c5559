"""Channel: a FIFO between worker groups, keyed so micro-batches route to the right peer.

Items one process puts under a key come out of ``get(key)`` in the order it put
them. ``put`` does not wait; ``get`` blocks until an item is there. Large items
(camera images) travel through Ray's object store and the channel actor only queues
their references, so it costs next to no CPU; small ones (actions) ride in the call.
:class:`InOrder` keeps the next ``get`` in flight while the caller works, which hides
the round trips in a pipeline.

Ray does not promise to run one caller's calls to a concurrent (async) actor in
submission order, so every put carries its producer's id and a sequence number,
and the store releases each producer's items in sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import defaultdict
from typing import Any

# every process that puts is one producer; its sequence numbers live here, per channel and key,
# so copies of a Channel passed to the same process in several calls share one sequence
_PRODUCER = uuid.uuid4().hex
_NEXT_SEQ: dict[tuple[str, Any], int] = defaultdict(int)
_INLINE_BYTES = 64 * 1024  # smaller items go by value: one hop less than the object store


def observation_key(env_rank: int, stage: int) -> tuple[str, int, int]:
    """Where env worker ``env_rank`` puts micro-batch ``stage``'s :class:`~envs.messages.StepMessage`."""
    return ("obs", env_rank, stage)


def action_key(env_rank: int, stage: int) -> tuple[str, int, int]:
    """Where a rollout worker puts the actions for env worker ``env_rank``'s micro-batch ``stage``."""
    return ("act", env_rank, stage)


def _nbytes(item: Any) -> int:
    """Bytes of the tensors / arrays in ``item`` (nested dicts, lists, tuples, dataclasses)."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(_nbytes(getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, dict):
        return sum(_nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(_nbytes(v) for v in item)
    return int(getattr(item, "nbytes", 0))


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
        payload = ("value", item) if _nbytes(item) < _INLINE_BYTES else ("ref", [ray.put(item)])
        self._store.put.remote(key, payload, _PRODUCER, seq)

    def get_async(self, key: Any = "default") -> Pending:
        """Ask for the next item under ``key`` now; :meth:`Pending.wait` returns it."""
        return Pending(self._store.get.remote(key))

    def get(self, key: Any = "default", timeout: float | None = None) -> Any:
        return self.get_async(key).wait(timeout)

    def qsize(self, key: Any = "default") -> int:
        import ray

        return ray.get(self._store.qsize.remote(key))

    def close(self) -> None:
        """End the channel: a worker blocked in ``get`` raises (``ActorDiedError``), which frees
        the survivors of a call aborted because a peer failed."""
        import ray

        ray.kill(self._store)


class Pending:
    """An item asked for with :meth:`Channel.get_async`."""

    def __init__(self, ref):
        self._ref = ref

    def wait(self, timeout: float | None = None) -> Any:
        import ray

        kind, payload = ray.get(self._ref, timeout=timeout)
        return ray.get(payload[0], timeout=timeout) if kind == "ref" else payload


class InOrder:
    """Gets the items of ``keys`` one after another, with the next request in flight
    while the caller works on the current item."""

    def __init__(self, channel: Channel, keys: list):
        self.channel = channel
        self.keys = keys
        self.index = 0
        self.pending = channel.get_async(keys[0]) if keys else None

    def next(self) -> Any:
        item = self.pending.wait()
        self.index += 1
        self.pending = self.channel.get_async(self.keys[self.index]) if self.index < len(self.keys) else None
        return item
