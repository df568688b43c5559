"""How the actor's weights reach the rollout workers, one class per ``placement.weight_sync``.

The driver holds one :class:`WeightSync` for a run (``Workers.weight_sync``): :meth:`~WeightSync.setup`
once the groups are up (and again after workers were replaced), :meth:`~WeightSync.publish` on the
actor's side while it is resident, :meth:`~WeightSync.receive` on the rollout workers' side once they
hold the devices. The workers' halves (shared buffers, broadcasts) are in scheduler/runtime/weight_sync.py.
"""

from __future__ import annotations

from collections.abc import Callable

from envs.common import Registry
from scheduler.runtime.worker import WorkerGroup

WEIGHT_SYNCS = Registry("weight sync (placement.weight_sync)")

Wait = Callable[..., list]  # the watchdog's get(refs, call, fetch=True): waits within the call's deadline


class WeightSync:
    """The driver's side of one weight-sync strategy between the ``actor`` and ``rollout`` groups.

    ``fixed_membership``: the strategy's peers form a group that cannot take a new member (a
    torch.distributed broadcast), so a replaced rollout worker means restarting all of them."""

    fixed_membership = False

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, wait: Wait):
        self.actor, self.rollout, self.wait = actor, rollout, wait

    def setup(self) -> None:
        """Connect the actor and the rollout workers (after a start, or after workers were replaced)."""

    def publish(self) -> None:
        """The actor's side: make its current weights available."""

    def receive(self) -> None:
        """The rollout workers' side: take the weights :meth:`publish` made available."""


@WEIGHT_SYNCS.register("shared_memory")
class SharedMemorySync(WeightSync):
    """One flat ``/dev/shm`` buffer the actor writes; CPU rollout workers use views of it as their
    parameters (nothing to copy), GPU ones copy from it. One node only."""

    def setup(self) -> None:
        layout = self.actor.call("share_weights")[0]
        self.rollout.call("attach_shared_weights", layout)
        self.actor.call("unlink_shared_weights")  # every mapping is made: nothing left to clean up

    def publish(self) -> None:
        self.actor.call("publish_weights")

    def receive(self) -> None:
        self.rollout.call("use_shared_weights")


@WEIGHT_SYNCS.register("object_store")
class ObjectStoreSync(WeightSync):
    """The weights go through Ray's object store: any node, one copy per rollout worker."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, wait: Wait):
        super().__init__(actor, rollout, wait)
        self._weights = None  # the object-store reference publish() left for receive()

    def publish(self) -> None:
        refs = self.actor.call_async("get_weights")  # every rank: FSDP gathers the shards
        self.wait(refs, "actor.get_weights", fetch=False)  # read before the actor may be offloaded
        self._weights = refs[0]

    def receive(self) -> None:
        self.rollout.call("set_weights", self._weights)


@WEIGHT_SYNCS.register("broadcast")
class BroadcastSync(WeightSync):
    """One torch.distributed broadcast from the actor (rank 0) to every rollout worker (NCCL between
    GPUs, gloo on CPU), any node; actor and rollout workers are both resident during it (make_plan)."""

    fixed_membership = True

    def setup(self) -> None:
        address = self.actor.call("group_address")[0]
        world = 1 + len(self.rollout)
        self.wait(self.actor.call_async("join_broadcast_group", address, world)
                  + self.rollout.call_async("join_broadcast_group", address, world), "weight_sync")

    def publish(self) -> None:
        self.wait(self.actor.call_async("broadcast_weights") + self.rollout.call_async("receive_broadcast"),
                  "weight_sync")


def make_weight_sync(name: str, actor: WorkerGroup, rollout: WorkerGroup, wait: Wait) -> WeightSync:
    """The strategy ``name`` (a resolved ``placement.weight_sync``, see scheduler/placement.py)."""
    return WEIGHT_SYNCS.get(name)(actor, rollout, wait)
