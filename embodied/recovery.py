"""Recovery from worker faults, for training and evaluation alike.

The watchdog finds a fault (scheduler/runtime/faults.py) and the call raises a ``WorkerFailure``;
:meth:`Recovery.guarded` catches it, spends one restart of the worker's group
(:meth:`FaultLog.spend`: beyond ``runner.max_worker_restarts`` within
``runner.restart_window_minutes`` it raises :class:`~scheduler.runtime.faults.RestartBudgetExceeded`),
replaces the workers (``Workers.recover``), restores a lost actor through its caller's hook,
and adds a :class:`FaultRecord` per worker; the caller redoes the piece of work the fault broke.
The records become TensorBoard scalars (``faults/``) and the ``faults`` section of ``eval.json``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from embodied.allocation import allocation_failure_of
from embodied.config import RunnerConfig
from scheduler.runtime.faults import RestartBudget, RestartBudgetExceeded, WorkerFailure, WorkerFault

if TYPE_CHECKING:
    from embodied.runner import Workers


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


def _raise(exceeded: RestartBudgetExceeded, failure: WorkerFailure) -> None:
    raise exceeded


class Recovery:
    """Runs pieces of work on ``workers`` so that a worker fault does not end them (see the module
    docstring). What it cannot know of its caller comes as hooks:

    - ``note(line)``: tell the user (the run log, or stderr);
    - ``restore_actor() -> (iterations lost, what was done)``: a replaced actor group holds its
      initial weights; load what the caller trains or evaluates;
    - ``now() -> (minute of training, iteration)``: when a fault is recorded;
    - ``give_up(exceeded, failure)``: over the restart budget; save what can be saved, then raise;
    - ``recovered()``: after each recovery (TensorBoard scalars, envs to reset, ...).
    """

    def __init__(self, workers: Workers, faults: FaultLog, note: Callable[[str], None],
                 restore_actor: Callable[[], tuple[int, str]], now: Callable[[], tuple[float, int]] = lambda: (0.0, 0),
                 give_up: Callable[[RestartBudgetExceeded, WorkerFailure], None] = _raise,
                 recovered: Callable[[], None] = lambda: None):
        self.workers, self.faults, self.note = workers, faults, note
        self.restore_actor, self.now, self.give_up, self.recovered = restore_actor, now, give_up, recovered
        self.recovering = False  # True while workers are being replaced (embodied chaos waits for it)

    def guarded(self, work: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, work())``, or ``(False, None)`` when a worker failed during it and was
        replaced (every failure met while recovering is recovered from too, within the budget)."""
        try:
            return True, work()
        except WorkerFailure as failure:
            refused = allocation_failure_of(failure)  # a failed allocation: the run's settings, not a fault (exit 2)
            if refused is not None:
                raise refused from None
            pending: WorkerFailure | None = failure
            while pending is not None:
                pending = self._recover(pending)
            return False, None

    def _recover(self, failure: WorkerFailure) -> WorkerFailure | None:
        """Spend a restart (beyond the budget: ``give_up``), replace the failed workers, restore a
        lost actor, and record each fault. Returns a failure met on the way, None when the work
        can go on."""
        started, detected_at = time.perf_counter(), time.time()
        minute, iteration = self.now()
        self.recovering = True
        try:
            try:
                self.faults.spend(failure)
            except RestartBudgetExceeded as exceeded:
                self.give_up(exceeded, failure)
                raise
            self.note(f"{failure}; replacing the workers")
            faults = self.workers.recover(failure)
            lost, action = self.restore_actor() if any(f.group == "actor" for f in faults) else (0, "replaced")
        except WorkerFailure as again:
            return again
        finally:
            self.recovering = False
        seconds = time.perf_counter() - started
        envs_each = self.workers.layout.envs_per_worker
        actions = {"actor": action, "channel": "channel renewed"}
        recovery = len({r.recovery for r in self.faults.records})
        for fault in faults or [WorkerFault("channel", 0, "stalled", failure.call, failure.detail)]:
            self.faults.add(FaultRecord(
                minute=minute, detected_at=detected_at, iteration=iteration, call=failure.call,
                group=fault.group, rank=fault.rank, kind=fault.kind, pid=fault.pid, detail=fault.detail,
                action=actions.get(fault.group, "replaced"), iterations_lost=lost if fault.group == "actor" else 0,
                episodes_failed=envs_each if fault.group == "env" and failure.call == "rollout" else 0,
                recovery=recovery, recovery_s=seconds))
            if fault.group == "actor":
                lost = 0  # the group's loss, counted once
        self.recovered()
        self.note(f"recovered in {seconds:.1f} s ({action}); {len(self.faults.records)} fault(s) so far")
        return None
