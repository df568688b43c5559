"""Worker faults: which worker failed and how, the deadlines that catch a hang, and the budget
of restarts a run allows.

The runner waits on every remote call through :class:`Watchdog` (``Workers.get`` in
embodied/runner.py). A call that raises because a worker died, or that outlives its
deadline, becomes a :class:`WorkerFailure` naming each faulty worker as a :class:`WorkerFault`:

- ``dead``: its process is gone (``ActorDiedError`` / ``RayActorError``: killed, crashed, out
  of memory);
- ``node_failed``: dead, and so is the Ray node it ran on;
- ``hung``: the call outlived its deadline and the worker does not answer a ping (a stopped
  process), or answers but is busy in its own work, not waiting on a peer, and does not compute
  (under 5% of a core: a deadlock, a simulator that stopped inside a step);
- ``crashed``: it raised (an env process that crashed below an EnvWorker).

Each worker is judged by its own answers (:func:`judge_hung`), never by a call of it that waits on
another: the pings and questions run on threads of their own in every worker
(``CONTROL_METHODS`` in scheduler/runtime/worker.py), so a worker blocked on a hung peer answers
and is kept (the recovery's new channel ends its call). A worker past its deadline that answers and
works in its own right (its CPU time grows: a loaded machine, a call whose cost jumped, as SAC's
first real update after its no-op ones) is waited for, up to the start-up deadline.

A rank whose constructor outlives its start-up deadline (first start or replacement) is ``hung``
too: :func:`scheduler.runtime.worker.wait_ready` raises that :class:`WorkerFailure`. The fault classes
are defined in scheduler/runtime/worker.py for that reason (this module builds on it); import them from
either.

A deadline is ``max(floor, factor x the slowest of the call's recent durations)``, or a fixed
override; before a call was ever measured it is the start-up deadline (the first rollout pays
for imports and renderer set-up).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable

from envs.common import UserError
from scheduler.runtime.worker import WorkerFailure, WorkerFault, WorkerGroup


class RestartBudgetExceeded(Exception):
    """More restarts of one group within the window than ``runner.max_worker_restarts`` allows."""

    def __init__(self, fault: WorkerFault, restarts: int, limit: int, window_minutes: float):
        self.fault, self.restarts, self.limit, self.window_minutes = fault, restarts, limit, window_minutes
        self.checkpoint: str | None = None  # what the runner saved on the way out
        self.run_dir = "<run_dir>"  # the run to resume
        super().__init__(fault.describe())

    def message(self) -> str:
        """The one paragraph a user reads: which worker, how often, its last log lines, how to go on."""
        saved = (f"A checkpoint was written now: {self.checkpoint}." if self.checkpoint
                 else "The actor was lost with it: the last periodic checkpoint is the newest.")
        tail = "\n".join(f"    {line}" for line in self.fault.log_tail[-10:]) or "    (no log lines found)"
        return (f"The run stopped: {self.fault.describe()}. That is restart {self.restarts} of the "
                f"{self.fault.group} workers within {self.window_minutes:g} minutes, beyond "
                f"runner.max_worker_restarts={self.limit}. {saved} Its last log lines:\n{tail}\n"
                f"Find the cause (memory: `dmesg`, the simulator: `embodied check-render`), then continue with "
                f"`embodied train resume={self.run_dir}` (raise runner.max_worker_restarts or "
                f"runner.restart_window_minutes to tolerate more).")


class Deadlines:
    """How long the runner waits for each kind of call (see the module docstring)."""

    def __init__(self, floor_s: float, factor: float, first_s: float, fixed_s: float | None = None,
                 window: int = 20):
        self.floor_s, self.factor, self.first_s, self.fixed_s = floor_s, factor, first_s, fixed_s
        self.history: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))

    def of(self, call: str) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        seen = self.history.get(call)
        if not seen:
            return max(self.first_s, self.floor_s)
        return max(self.floor_s, self.factor * max(seen))

    def record(self, call: str, seconds: float) -> None:
        self.history[call].append(seconds)


class RestartBudget:
    """At most ``limit`` restarts of each group within any ``window_s`` seconds."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.restarts: dict[str, list[float]] = defaultdict(list)

    def spend(self, group: str) -> int:
        """Count one restart of ``group``; returns how many fall in the window, this one included
        (more than ``limit``: over budget)."""
        now = self.clock()
        recent = [t for t in self.restarts[group] if now - t < self.window_s] + [now]
        self.restarts[group] = recent
        return len(recent)


class Watchdog:
    """Waits on the refs of calls to ``groups`` with deadlines; a dead or hung worker becomes a
    :class:`WorkerFailure`. Refs of calls in flight stay listed until they settle, so an aborted
    call's survivors can be waited for (:meth:`settle`). While it waits it pings the workers every
    ``probe_every_s`` (``runner.probe_every_s``; 5 s for callers without a config), so a dead one
    is found then, not at the deadline; a ping unanswered for ``ping_timeout_s`` (``runner.ping_timeout_s``;
    10 s for callers without a config) is a silent worker."""

    def __init__(self, deadlines: Deadlines, probe_every_s: float = 5.0, ping_timeout_s: float = 10.0):
        self.groups: dict[str, WorkerGroup] = {}  # what :meth:`watch` was given
        self.deadlines = deadlines
        self.probe_every_s, self.ping_timeout_s = probe_every_s, ping_timeout_s
        self.in_flight: list = []

    def watch(self, group: WorkerGroup) -> WorkerGroup:
        """Include ``group`` in what a failed call is traced to (its ranks are pinged, inspected and
        named in a :class:`WorkerFailure`); returns it. Give the group :meth:`get` as its ``get``."""
        self.groups[group.name] = group
        return group

    def get(self, refs: list, call: str, fetch: bool = True, inspect: list | None = None) -> list:
        """Wait for ``refs`` (all from calls named ``call``) within ``call``'s deadline; returns
        their values. ``fetch=False`` only waits, leaving large results in the object store, and
        fetches just the (small) refs in ``inspect``; each fetched ref is read as soon as it is
        ready, so one that holds an error ends the wait at once, while its peers still block.
        Raises :class:`WorkerFailure`."""
        import ray

        self.in_flight += refs
        deadline = base = self.deadlines.of(call)
        # a worker still working past the deadline is waited for up to the start-up deadline (not past a fixed one)
        limit = base if self.deadlines.fixed_s is not None else max(base, self.deadlines.first_s)
        started = last_probe = time.perf_counter()
        watched = {r.hex() for r in (refs if fetch else inspect or [])}
        values: dict[str, object] = {}
        pending = list(refs)
        while pending:
            elapsed = time.perf_counter() - started
            if elapsed > deadline:
                detail = (f"no answer within its deadline of {base:.0f} s" if deadline == base else
                          f"no answer within {elapsed:.0f} s (its deadline of {base:.0f} s, extended while it worked)")
                failure = self._failure(call, pending, detail, timeout=True)
                if elapsed >= limit or not self._still_working(failure, pending):
                    raise failure
                deadline = min(limit, time.perf_counter() - started + base)
                print(f"watchdog: {call} is past its deadline of {base:.0f} s, but "
                      f"{', '.join(f'{f.group} rank {f.rank}' for f in failure.faults)} still works (its CPU time "
                      f"grows): waiting up to {deadline:.0f} s", file=sys.stderr, flush=True)
                continue
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(self.probe_every_s, deadline - elapsed),
                                      fetch_local=False)
            values.update(self._read(call, [r for r in ready if r.hex() in watched]))
            if pending and time.perf_counter() - last_probe >= self.probe_every_s:
                last_probe = time.perf_counter()
                dead = self._dead_workers(call)
                if dead:
                    raise _with_log_tails(WorkerFailure(call, dead, "a worker died"))
        self.deadlines.record(call, time.perf_counter() - started)
        self._forget(refs)
        return [values.get(r.hex()) for r in refs]

    def _read(self, call: str, refs: list) -> dict[str, object]:
        """The values of finished ``refs`` by hex id; an error in one is a :class:`WorkerFailure`."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if not refs:
            return {}
        try:
            return {r.hex(): value for r, value in zip(refs, ray.get(refs), strict=True)}
        except (RayActorError, RayTaskError) as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, UserError):  # bad input a worker found: the same on every retry, so not a fault
                raise UserError(str(cause)) from None
            raise self._failure(call, [], _first_line(err), error=err) from None

    # -- diagnosis ----------------------------------------------------------------------
    def _failure(self, call: str, pending: list, detail: str, timeout: bool = False,
                 error: BaseException | None = None) -> WorkerFailure:
        faults = self._dead_workers(call)
        crashed = _crashed_worker(error, self.groups, call) if error is not None else None
        if crashed is not None and not any((f.group, f.rank) == (crashed.group, crashed.rank) for f in faults):
            faults.append(crashed)
        if timeout:
            faults += self._hung_workers(call, pending, detail, known={(f.group, f.rank) for f in faults})
        return _with_log_tails(WorkerFailure(call, faults, detail))

    def _ping_all(self, timeout_s: float) -> dict[tuple[str, int], str]:
        """``(group, rank) -> "alive" | "dead" | "silent"`` (no answer within ``timeout_s``)."""
        import ray

        pings = {(name, rank): worker.ping.remote()
                 for name, group in self.groups.items() for rank, worker in enumerate(group.workers)}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        ready = set(ready)
        status = {}
        for key, ref in pings.items():
            if ref not in ready:
                status[key] = "silent"
                continue
            try:
                ray.get(ref)
                status[key] = "alive"
            except Exception:
                status[key] = "dead"
        return status

    def _dead_workers(self, call: str) -> list[WorkerFault]:
        faults = []
        for (name, rank), state in self._ping_all(timeout_s=min(self.ping_timeout_s, 2.0)).items():
            if state == "dead":
                process = self.groups[name].processes[rank]
                node = process.node_id if process else None
                kind = "node_failed" if node is not None and not _node_alive(node) else "dead"
                faults.append(WorkerFault(name, rank, kind, call, "its process is gone",
                                          process.pid if process else None, node))
        return faults

    def _hung_workers(self, call: str, pending: list, deadline: str, known: set) -> list[WorkerFault]:
        """After a deadline: workers that do not answer a ping, else those still busy with the call
        in their own work (not waiting on a peer); each judged by its own answers (:func:`judge_hung`)."""
        import ray

        status = self._ping_all(self.ping_timeout_s)
        busy = {self._owner(ref) for ref in pending} - {None} - known
        waiting: dict[tuple[str, int], bool | None] = {}
        if not _silent(status, known):  # what the busy ones do: asked on their control threads, with a timeout
            asked = {key: self.groups[key[0]].workers[key[1]].activity.remote() for key in sorted(busy)
                     if status.get(key) == "alive"}
            answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=self.ping_timeout_s)
            waiting = {key: _value_or_none(ref) if ref in answered else None for key, ref in asked.items()}
        return [self._fault(name, rank, "hung", call, f"{deadline}; {why}")
                for (name, rank), why in judge_hung(status, busy, waiting, known)]

    def _still_working(self, failure: WorkerFailure, pending: list, window_s: float = 5.0,
                       share: float = 0.05) -> bool:
        """Whether every worker ``failure`` names is busy in its own work (none silent, dead or crashed)
        and uses at least ``share`` of a core over the next ``window_s`` (its process and simulators):
        slow, not hung. Waits on ``pending`` meanwhile."""
        import ray

        if not failure.faults or any(f.kind != "hung" or not f.detail.endswith(BUSY) for f in failure.faults):
            return False
        workers = [self.groups[f.group].workers[f.rank] for f in failure.faults]
        before = self._ask(workers, "cpu_seconds")
        ray.wait(pending, num_returns=len(pending), timeout=window_s, fetch_local=False)
        after = self._ask(workers, "cpu_seconds")
        return all(a is not None and b is not None and b - a >= share * window_s
                   for a, b in zip(before, after, strict=True))

    def _ask(self, workers: list, method: str) -> list:
        """Each worker's answer to ``method`` (a control method), None where none came within the ping timeout."""
        import ray

        refs = [getattr(worker, method).remote() for worker in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.ping_timeout_s)
        return [_value_or_none(ref) if ref in ready else None for ref in refs]

    def _fault(self, group: str, rank: int, kind: str, call: str, detail: str) -> WorkerFault:
        process = self.groups[group].processes[rank]
        return WorkerFault(group, rank, kind, call, detail, process.pid if process else None,
                           process.node_id if process else None)

    def _owner(self, ref) -> tuple[str, int] | None:
        """Which worker a ref's call runs on (matched by the actor that owns the task)."""
        task_actor = ref.task_id().actor_id()
        for name, group in self.groups.items():
            for rank, worker in enumerate(group.workers):
                if worker._actor_id == task_actor:
                    return name, rank
        return None

    # -- after a failure ------------------------------------------------------------------
    def settle(self, timeout_s: float) -> list[tuple[str, int]]:
        """Wait up to ``timeout_s`` for the calls still in flight (an aborted call's survivors end
        once their channel is gone); returns the workers whose calls did not end."""
        import ray

        refs, self.in_flight = self.in_flight, []
        if not refs:
            return []
        _, stuck = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        return sorted({self._owner(ref) for ref in stuck} - {None})

    def _forget(self, refs: list) -> None:
        done = {r.hex() for r in refs}
        self.in_flight = [r for r in self.in_flight if r.hex() not in done]


SILENT = "it does not answer a ping"
BUSY = "busy in its own work, not waiting on a peer"


def judge_hung(status: dict[tuple[str, int], str], busy: set[tuple[str, int]],
               waiting: dict[tuple[str, int], bool | None], known: set) -> list[tuple[tuple[str, int], str]]:
    """Which workers a call that outlived its deadline is traced to, and why: each worker is judged by
    its own answers, never by a call of it that waits on another. ``status``: each worker's ping
    (``alive`` / ``dead`` / ``silent``); ``busy``: the workers whose part of the call is still running;
    ``waiting``: of those, whether each waits on a peer right now (absent or None: no answer); ``known``:
    workers already named. A silent worker is the hang (its peers, blocked on it, answer); with none
    silent, a busy worker that says it is not waiting on a peer is stuck in its own work (a simulator
    step). One that answered its ping but not the question is alive, so not named: if its call does
    not end once the channel is renewed, the recovery's settle names it."""
    silent = _silent(status, known)
    if silent:
        return [(key, SILENT) for key in silent]
    return [(key, BUSY) for key in sorted(busy - known) if waiting.get(key) is False]


def _silent(status: dict[tuple[str, int], str], known: set) -> list[tuple[str, int]]:
    return sorted(key for key, state in status.items() if state == "silent" and key not in known)


def _value_or_none(ref):
    import ray

    try:
        return ray.get(ref)
    except Exception:
        return None


def _with_log_tails(failure: WorkerFailure) -> WorkerFailure:
    for fault in failure.faults:
        fault.log_tail = log_tail(fault.pid)
    return failure


def _crashed_worker(error: BaseException, groups: dict[str, WorkerGroup], call: str) -> WorkerFault | None:
    """The worker whose own code raised ``error`` (a ``RayTaskError``), found by its pid."""
    from ray.exceptions import RayActorError, RayTaskError

    if not isinstance(error, RayTaskError) or isinstance(error, RayActorError):
        return None
    # an error raised as its cause's type too (RayTaskError(EnvCrashedError)) may lack ``pid``: its text has it
    pid = getattr(error, "pid", None) or _pid_in(str(error))
    for name, group in groups.items():
        for rank, process in enumerate(group.processes):
            if process is not None and process.pid == pid:
                cause = error.cause if error.cause is not None else error
                return WorkerFault(name, rank, "crashed", call, _first_line(cause), process.pid, process.node_id)
    return None


def _pid_in(text: str) -> int | None:
    found = re.search(r"\(pid=(\d+)", text)
    return int(found.group(1)) if found else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"[:300]


def _node_alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def log_tail(pid: int | None, lines: int = 20) -> list[str]:
    """The last ``lines`` lines a worker process wrote (Ray keeps ``worker-*-<pid>.{out,err}`` in
    its session's logs folder); empty where none is found (a worker on another node)."""
    if pid is None:
        return []
    try:
        import ray

        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:
        return []
    found: list[str] = []
    for path in sorted(glob.glob(os.path.join(logs, f"worker-*-{pid}.*"))):
        try:
            with open(path, errors="replace") as f:
                # Ray marks which job and actor a worker serves with lines of its own: not the worker's words
                found += [line.rstrip() for line in f.readlines()[-lines:]
                          if line.strip() and not line.startswith((":job_id:", ":actor_name:", ":task_name:"))]
        except OSError:
            continue
    return found[-lines:]
