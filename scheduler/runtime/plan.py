"""The resolved placement the runtime works from: which devices a cluster has (``ClusterDevices``), where each
worker group's ranks run (``GroupPlacement``), and the whole ``Plan`` (mode, pipeline stages, offload, weight-sync
strategy). Built from config by :func:`scheduler.placement.make_plan`; read by the worker groups, the context
switcher and the weight sync, which never decide placement themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUPS = ("env", "rollout", "actor")
PHASES = {"generate": ("env", "rollout"), "train": ("actor",)}  # groups that run together


@dataclass(frozen=True)
class Device:
    """One device of the cluster: its global index, the Ray node it is on, its index there."""

    index: int
    node_id: str
    local_index: int


@dataclass(frozen=True)
class ClusterDevices:
    kind: str  # "gpu" | "cpu"
    devices: list[Device]

    @staticmethod
    def single_node(kind: str, count: int, node_id: str = "local") -> ClusterDevices:
        return ClusterDevices(kind, [Device(i, node_id, i) for i in range(count)])


@dataclass(frozen=True)
class GroupPlacement:
    name: str
    num_workers: int
    devices: list[int]
    device_kind: str  # "gpu" | "cpu"

    def device_of(self, rank: int) -> int:
        return self.devices[rank % len(self.devices)]

    def used_devices(self) -> set[int]:
        return {self.device_of(r) for r in range(self.num_workers)}

    def share(self, plan: Plan) -> float:
        """Fraction of a device each rank requests: devices are shared by every rank on them."""
        users = plan.ranks_per_device()
        return 1.0 / max(users[d] for d in self.used_devices())


@dataclass(frozen=True)
class Plan:
    mode: str
    groups: dict[str, GroupPlacement]
    cluster: ClusterDevices
    pipeline_stages: int = 1
    offload: bool = False  # offload groups that share a device with the running phase
    weight_sync: str = "object_store"
    pin_cpus: bool = False  # pin CPU workers to their slot's core

    @property
    def device_kind(self) -> str:
        return self.cluster.kind

    def device(self, group: str, rank: int) -> Device:
        return self.cluster.devices[self.groups[group].device_of(rank)]

    def update_threads(self, actor_threads: int) -> list[int]:
        """Each actor rank's intra-op threads while it updates (``placement.actor_threads``). CPU
        ranks on one node share its cores: they split the threads, so that together they run as
        many as one rank would (more would only contend for the cores). GPU ranks: each all."""
        actor = self.groups["actor"]
        nodes = [self.device("actor", r).node_id for r in range(actor.num_workers)]
        if self.device_kind != "cpu":
            return [actor_threads] * len(nodes)
        return [max(1, actor_threads // nodes.count(node)) for node in nodes]

    def ranks_per_device(self) -> dict[int, int]:
        users: dict[int, int] = {}
        for group in self.groups.values():
            for rank in range(group.num_workers):
                d = group.device_of(rank)
                users[d] = users.get(d, 0) + 1
        return users

    def shares_device(self, a: str, b: str) -> bool:
        """Do any ranks of groups ``a`` and ``b`` sit on the same device?"""
        return bool(self.groups[a].used_devices() & self.groups[b].used_devices())

    def same_node(self, a: str, b: str) -> bool:
        """Are all ranks of groups ``a`` and ``b`` on one Ray node?"""
        nodes = {self.cluster.devices[d].node_id for g in (a, b) for d in self.groups[g].used_devices()}
        return len(nodes) == 1

    def describe(self) -> str:
        parts = [f"{name} x{g.num_workers} on {ranges_text(sorted(g.used_devices()))}"
                 for name, g in self.groups.items()]
        return (f"{self.mode} ({self.cluster.kind}): " + ", ".join(parts)
                + f"; {self.pipeline_stages} stage(s); weight sync {self.weight_sync}"
                + ("; offload" if self.offload else "") + ("; pinned to cores" if self.pin_cpus else ""))


def ranges_text(devices: list[int]) -> str:
    return ",".join(str(d) for d in devices)
