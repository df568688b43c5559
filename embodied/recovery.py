"""What a training run keeps of its worker faults: the restart budget, and the record users read.

The runner finds a fault (scheduler/runtime/faults.py), spends one restart of the worker's group
here (:meth:`FaultLog.spend`: beyond ``runner.max_worker_restarts`` within
``runner.restart_window_minutes`` it raises :class:`~scheduler.runtime.faults.RestartBudgetExceeded`),
replaces the workers (``Workers.recover``), then adds a :class:`FaultRecord` per worker. The
records become TensorBoard scalars (``faults/``) and the ``faults`` section of ``eval.json``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from embodied.config import RunnerConfig
from scheduler.runtime.faults import RestartBudget, RestartBudgetExceeded, WorkerFailure, WorkerFault


@dataclass
class FaultRecord:
    """One worker fault the run survived."""

    minute: float  # of training, when it was found
    detected_at: float  # ... and its unix time
    iteration: int  # iterations completed when it was found
    call: str  # what the runner waited on
    group: str
    rank: int
    kind: str  # dead | hung | node_failed | crashed (scheduler/runtime/faults.py); "stalled": no worker at fault
    pid: int | None
    detail: str
    action: str  # what was done: "replaced", "actor group restored from ckpt_000010.pt", ...
    iterations_lost: int  # completed iterations rolled back (an actor restored from an older checkpoint)
    episodes_failed: int  # episodes in progress on the lost env worker: they end as failed by error
    recovery: int  # which recovery handled it (one recovery can replace several workers)
    recovery_s: float  # that recovery's time, from the fault's detection to the run going on


class FaultLog:
    """Counts restarts against the budget and keeps the record of faults survived."""

    def __init__(self, runner: RunnerConfig):
        self.limit, self.window_minutes = runner.max_worker_restarts, runner.restart_window_minutes
        self.budget = RestartBudget(self.limit, self.window_minutes * 60)
        self.records: list[FaultRecord] = []

    def spend(self, failure: WorkerFailure) -> None:
        """One restart of each group ``failure`` names (a call that stalled with no worker at
        fault: one of the channel's); raises RestartBudgetExceeded beyond the budget."""
        faults = failure.faults or [WorkerFault("channel", 0, "stalled", failure.call, failure.detail)]
        for group in sorted({f.group for f in faults}):
            restarts = self.budget.spend(group)
            if restarts > self.limit:
                fault = next(f for f in faults if f.group == group)
                raise RestartBudgetExceeded(fault, restarts, self.limit, self.window_minutes)

    def add(self, record: FaultRecord) -> None:
        self.records.append(record)

    def scalars(self) -> dict[str, float]:
        """``faults/`` TensorBoard scalars: totals so far, by group, and what they cost."""
        by_group = Counter(r.group for r in self.records)
        return {"faults/total": len(self.records), **{f"faults/{g}": n for g, n in by_group.items()},
                "faults/iterations_lost": sum(r.iterations_lost for r in self.records),
                "faults/episodes_failed": sum(r.episodes_failed for r in self.records),
                "faults/recovery_s": self.recovery_seconds()}

    def recovery_seconds(self) -> float:
        return sum({r.recovery: r.recovery_s for r in self.records}.values())

    def summary(self) -> dict:
        """The ``faults`` section of ``eval.json``: what died, when, and what was lost."""
        return {"count": len(self.records), "by_group": dict(Counter(r.group for r in self.records)),
                "by_kind": dict(Counter(r.kind for r in self.records)),
                "iterations_lost": sum(r.iterations_lost for r in self.records),
                "episodes_failed": sum(r.episodes_failed for r in self.records),
                "recovery_s": self.recovery_seconds(),
                "events": [asdict(r) for r in self.records]}
