"""The driver side of context switching: groups that share devices take turns.

Workers implement ``offload()`` / ``onload()`` (see :mod:`scheduler.runtime.offload`); the
driver's :class:`ContextSwitcher` decides who holds the devices.
"""

from __future__ import annotations

import time

from scheduler.runtime.plan import PHASES, Plan
from scheduler.runtime.worker import WorkerGroup


class ContextSwitcher:
    """The device lock of groups that share devices: one phase holds them at a time.

    Phases (``scheduler.runtime.plan.PHASES``): ``generate`` (env + rollout workers) and
    ``train`` (the actor). Before a phase runs, the other phase's groups that share a
    device with it offload (when the plan offloads at all) and its own groups onload.
    Only the driver calls :meth:`turn`, so turns never interleave.
    """

    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup]):
        self.plan = plan
        self.groups = groups
        self.resident = set(groups)

    def _get(self, refs: list, call: str) -> list:
        """Wait as the groups do (the runner's watchdog gives each call a deadline)."""
        return next(iter(self.groups.values())).get(refs, call)

    def workers_replaced(self) -> None:
        """New workers start resident: the next turn offloads whoever does not run."""
        self.resident = set(self.groups)

    def turn(self, phase: str) -> dict[str, float]:
        """Give the devices to ``phase``; returns switch time and bytes moved off devices."""
        if not self.plan.offload:
            return {}
        t0 = time.perf_counter()
        runs = PHASES[phase]
        leaving = sorted(g for g in self.resident - set(runs)
                         if any(self.plan.shares_device(g, r) for r in runs))
        reports = self._get([ref for g in leaving for ref in self.groups[g].call_async("offload")], "offload")
        self.resident -= set(leaving)
        t1 = time.perf_counter()
        arriving = [g for g in runs if g not in self.resident]
        self._get([ref for g in arriving for ref in self.groups[g].call_async("onload")], "onload")
        self.resident |= set(arriving)
        return {"offload_s": t1 - t0, "onload_s": time.perf_counter() - t1,
                "offloaded_mib": sum(r["bytes_moved"] for r in reports) / 2**20,
                **_device_freed(reports)}


def _device_freed(reports: list[dict]) -> dict[str, float]:
    """Device memory released by offloads (GPU only: CPU workers report none)."""
    freed = [r["device_bytes_before"] - r["device_bytes_after"] for r in reports
             if r.get("device_bytes_before") is not None]
    return {"device_freed_mib": sum(freed) / 2**20} if freed else {}
