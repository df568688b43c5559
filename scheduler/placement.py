"""Where each worker group runs: a Plan resolved from ``placement`` config.

Devices are GPUs on a machine with GPUs and CPU slots otherwise. A group's device
range (``"0-1"``, ``"0,2"``, ``"3"``) lists the devices its ranks are spread over;
rank ``i`` lands on device ``range[i % len(range)]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from embodied.errors import UserError

GROUPS = ("env", "rollout", "actor")
MODES = ("colocated",)


def parse_devices(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    devices: list[int] = []
    try:
        for part in str(spec).split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                if hi < lo:
                    raise ValueError
                devices.extend(range(lo, hi + 1))
            else:
                devices.append(int(part))
    except ValueError:
        raise UserError(f"Bad device range {spec!r} in placement: write it like \"0-3\", \"0,2\" or \"1\".") from None
    return devices


@dataclass(frozen=True)
class GroupPlacement:
    name: str
    num_workers: int
    devices: list[int]
    device_kind: str  # "gpu" | "cpu"

    def device_of(self, rank: int) -> int:
        return self.devices[rank % len(self.devices)]

    def share(self, plan: Plan) -> float:
        """Fraction of a device each rank requests: devices are shared by every rank on them."""
        users = plan.ranks_per_device()
        return 1.0 / max(users.get(d, 1) for d in self.devices)


@dataclass(frozen=True)
class Plan:
    mode: str
    groups: dict[str, GroupPlacement]
    device_kind: str
    num_devices: int

    def ranks_per_device(self) -> dict[int, int]:
        users: dict[int, int] = {}
        for group in self.groups.values():
            for rank in range(group.num_workers):
                d = group.device_of(rank)
                users[d] = users.get(d, 0) + 1
        return users


def make_plan(placement_cfg, num_gpus: int, num_cpus: int, num_envs: int) -> Plan:
    """Validate ``placement_cfg`` against the cluster's devices and build the Plan."""
    if placement_cfg.mode not in MODES:
        raise UserError(f"placement.mode={placement_cfg.mode!r} is not available yet; use one of {MODES}.")
    kind = "gpu" if num_gpus > 0 else "cpu"
    available = num_gpus if num_gpus > 0 else num_cpus
    counts = {"env": placement_cfg.env_workers, "rollout": placement_cfg.rollout_workers,
              "actor": placement_cfg.actor_workers}
    groups = {}
    for name in GROUPS:
        devices = parse_devices(getattr(placement_cfg, name))
        bad = [d for d in devices if d >= available or d < 0]
        if bad:
            raise UserError(
                f"placement.{name}={getattr(placement_cfg, name)!r} names {kind} device(s) {bad}, "
                f"but the cluster has {available} {kind} device(s) (0-{available - 1}). "
                f"Change placement.{name} or give Ray more devices (ray.num_cpus / ray.num_gpus)."
            )
        if counts[name] < 1:
            raise UserError(f"placement.{name}_workers must be at least 1 (got {counts[name]}).")
        groups[name] = GroupPlacement(name, counts[name], devices, kind)
    if num_envs % counts["env"] != 0:
        raise UserError(
            f"env.num_envs={num_envs} does not split evenly over placement.env_workers={counts['env']}: "
            f"make num_envs a multiple of {counts['env']}."
        )
    if counts["actor"] != 1:
        raise UserError("placement.actor_workers > 1 (data-parallel training) is not available yet; set it to 1.")
    return Plan(placement_cfg.mode, groups, kind, available)
