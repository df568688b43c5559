"""Worker and WorkerGroup: N Ray actors of one class; a call on the group fans out to every rank.

    group = WorkerGroup(EnvWorker, "env", plan, env_cfg=...)
    group.call("reset", seed=1)          # -> [result of rank 0, result of rank 1, ...]
    refs = group.call_async("interact", ...)   # -> list of ObjectRefs

Starting a rank has a deadline too (:func:`wait_ready`): a constructor that hangs is a
:class:`WorkerFailure` naming the rank as ``hung``, as the runner's watchdog
(scheduler/runtime/faults.py) reports a call that hangs. The fault classes live here, not in faults.py,
because faults.py builds on :class:`WorkerGroup` and the import chain must not loop back.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from scheduler.runtime.plan import Plan

# How long a rank's constructor may take, first start or replacement, where the caller gives no
# deadline: the default of runner.first_call_deadline_s, the deadline of every call not yet measured
# (a start pays for imports, renderer and device set-up as a first call does). The runner passes
# that key's value; this is the fallback for other callers (embodied/sft.py, tests).
START_DEADLINE_S = 900.0

# methods that answer while a long call runs (the watchdog's pings and questions) get threads of their own;
# every other call runs on the worker's one call thread: torch's OpenMP keeps one thread pool per calling
# thread, and pools of several threads (Ray's default of calls on any of four) oversubscribe the cores, so
# OpenMP's threads sleep between operations: the actor's update ran 15-25% slower than in a plain process
CONTROL_METHODS = ("ping", "process", "activity", "node_id", "cpu_seconds")

FAULT_KINDS = {"dead": "died", "hung": "hung", "node_failed": "was lost with its node", "crashed": "raised"}


@dataclass
class WorkerFault:
    """One worker that failed during a call the runner waited on (or while it started)."""

    group: str  # "env" | "rollout" | "actor"
    rank: int
    kind: str  # a key of FAULT_KINDS
    call: str  # what the runner waited on, e.g. "rollout" or "actor.update"
    detail: str  # one line: the error, or the deadline that passed
    pid: int | None = None
    node_id: str | None = None
    log_tail: list[str] = field(default_factory=list)  # the worker's last log lines (Ray's log files)

    def describe(self) -> str:
        # a worker that never finished starting never told its pid
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        return f"{self.group} worker rank {self.rank}{pid} {FAULT_KINDS[self.kind]} during {self.call}: {self.detail}"


class WorkerFailure(Exception):
    """A call the runner waited on failed; ``faults`` names the workers to replace (empty: every
    worker answers and none is stuck in its own work, so the call stalled between them)."""

    def __init__(self, call: str, faults: list[WorkerFault], detail: str):
        self.call, self.faults, self.detail = call, faults, detail
        names = "; ".join(f.describe() for f in faults) or f"no worker at fault ({detail})"
        super().__init__(f"{call} failed: {names}")


@dataclass(frozen=True)
class WorkerProcess:
    """Where a worker runs: its process id and Ray node (what a fault report names, and what
    ``embodied chaos`` signals)."""

    pid: int
    node_id: str


class Worker:
    """Base class of every worker: knows its rank, group size and device."""

    # True while the worker waits for a peer (a channel item): a call that outlives its deadline
    # is then someone else's hang, not this worker's (scheduler/runtime/faults.py)
    waiting_on_peers = False
    # a subclass's quick read-only methods that, like CONTROL_METHODS, answer while a long call runs
    extra_control_methods: tuple[str, ...] = ()

    def __init__(self, rank: int, world_size: int, device_kind: str = "cpu", torch_threads: int = 1,
                 local_device: int = 0, pin_cpu: bool = False):
        self.rank = rank
        self.world_size = world_size
        self.node_cores = os.sched_getaffinity(0)
        self.pinned_core = pin_to_core(local_device) if pin_cpu else None
        torch.set_num_threads(torch_threads)
        use_cuda = device_kind == "gpu" and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{local_device}" if use_cuda else "cpu")

    # what offload() moves off the device while another group holds it (scheduler/runtime/offload.py);
    # None: nothing (CPU simulators hold no device memory, a GPU simulator just pauses:
    # PhysX cannot release its buffers without rebuilding the scene)
    device_state = None

    def ping(self) -> int:
        return self.rank

    def process(self) -> WorkerProcess:
        return WorkerProcess(os.getpid(), self.node_id())

    def activity(self) -> bool:
        """Whether this worker is waiting on a peer right now (see ``waiting_on_peers``)."""
        return self.waiting_on_peers

    def cpu_seconds(self) -> float:
        """CPU time used so far by this worker's process and the processes it started (its simulators):
        whether a worker past its call's deadline is still working (scheduler/runtime/faults.py)."""
        import psutil

        me = psutil.Process()
        total = sum(me.cpu_times()[:2])
        for child in me.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:  # it ended meanwhile
                pass
        return total

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark the time inside as waiting on a peer (a channel get)."""
        self.waiting_on_peers = True
        try:
            yield
        finally:
            self.waiting_on_peers = False

    def offload(self) -> dict:
        return self.device_state.offload().as_dict() if self.device_state is not None else {"bytes_moved": 0}

    def onload(self) -> dict:
        return self.device_state.onload().as_dict() if self.device_state is not None else {"bytes_moved": 0}

    @contextmanager
    def all_cores(self) -> Iterator[None]:
        """Let this worker's pinned threads, and the threads they start, use every core of the
        node for a while: a phase in which the other groups are idle (the actor's update).
        Ray's own threads keep their affinity. Not pinned: nothing to do."""
        if self.pinned_core is None:
            yield
            return
        pinned = {t for t in _threads() if _affinity(t) == {self.pinned_core}}
        for thread in pinned:
            _set_affinity(thread, self.node_cores)
        before = _threads()
        try:
            yield
        finally:
            for thread in pinned | (_threads() - before):  # new threads: the update's thread pool
                _set_affinity(thread, {self.pinned_core})

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@functools.cache
def _actor_class(cls: type):
    """``cls`` as a Ray actor class: calls on one thread, :data:`CONTROL_METHODS` (and the class's own
    ``extra_control_methods``: quick read-only questions) on threads of their own
    (a subclass carries the marks: ``cls`` itself stays usable with a plain ``ray.remote``)."""
    import ray

    def control(name: str) -> Callable:
        method = getattr(cls, name)

        def same(self, *args, **kwargs):
            return method(self, *args, **kwargs)

        # not functools.wraps: Ray reads a method's marks after ``inspect.unwrap``, which follows
        # ``__wrapped__`` back to the unmarked method, and the call then queues behind the running one
        # (a worker blocked on a peer never answered a ping: issue 57)
        same.__name__, same.__qualname__, same.__doc__ = name, f"{cls.__name__}.{name}", method.__doc__
        return ray.method(concurrency_group="control")(same)

    names = CONTROL_METHODS + tuple(getattr(cls, "extra_control_methods", ()))  # plain classes in tests too
    marked = type(cls.__name__, (cls,), {name: control(name) for name in names})
    actor_class = ray.remote(concurrency_groups={"control": len(names)})(marked)
    lost = sorted(set(names) - set(control_methods(actor_class)))
    if lost:  # a Ray that reads the marks elsewhere: the watchdog would take every busy worker for a hung one
        raise RuntimeError(f"Ray dropped the concurrency group of {', '.join(lost)} on {cls.__name__}: pings would "
                           "wait behind a running call")
    return actor_class


def control_methods(actor_class) -> dict[str, str]:
    """The methods of a Ray actor class that Ray runs in a concurrency group of their own, and the group
    (read from the class's metadata, as Ray built it)."""
    meta = getattr(actor_class, "__ray_metadata__", None)
    return dict(getattr(getattr(meta, "method_meta", None), "concurrency_group_for_methods", None) or {})


def resident_mib() -> float:
    """This process's resident memory (what a CPU slot's worker holds), in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def pin_to_core(slot: int) -> int:
    """Run this process, and the threads and processes it starts from now on, on one core:
    CPU slot ``slot`` of this node. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[slot % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _affinity(thread: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(thread)
    except OSError:  # the thread ended meanwhile
        return None


def _set_affinity(thread: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(thread, cores)
    except OSError:
        pass  # the thread ended meanwhile


class WorkerGroup:
    """The ranks of group ``name`` of ``plan``: Ray actors of ``cls``, each pinned to its device's node.

    A rank that died or hung is replaced by :meth:`replace` (same rank, same arguments);
    :meth:`restart` replaces them all. ``get`` is how :meth:`call` waits for its results: plain
    ``ray.get``, or the runner's watchdog (``Watchdog.get``), which gives every call a deadline
    (scheduler/runtime/faults.py).
    Every start, the first and each replacement, waits at most ``start_deadline_s`` for the
    constructors (:func:`wait_ready`).
    """

    def __init__(self, cls: type, name: str, plan: Plan, torch_threads: int = 1,
                 per_rank_kwargs: list[dict] | None = None, wait: bool = True,
                 start_deadline_s: float = START_DEADLINE_S, get: Callable[[list, str], list] | None = None,
                 **kwargs: Any):
        self.name = name
        self._cls, self._plan, self._threads = cls, plan, torch_threads
        self._per_rank_kwargs, self._kwargs = per_rank_kwargs, kwargs
        self.start_deadline_s = start_deadline_s
        self.get: Callable[[list, str], list] = get or _ray_get
        self.processes: list[WorkerProcess | None] = [None] * plan.groups[name].num_workers
        self.workers = [self._start(rank) for rank in range(len(self.processes))]
        if wait:
            try:
                wait_ready(self)
            except BaseException:
                # the caller never gets this group to shut down: its ranks would hold their slots
                self.shutdown()
                raise

    def _start(self, rank: int):
        """Start rank ``rank``'s actor (not waiting for its constructor)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        plan, placement = self._plan, self._plan.groups[self.name]
        share = placement.share(plan)
        if plan.device_kind == "gpu":
            # Ray's fractional GPUs only account; the worker picks its GPU itself (cuda:<local index>)
            keep_visible = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
            resources = {"num_gpus": share, "runtime_env": keep_visible}
        else:
            resources = {"num_cpus": share}
        device = plan.device(self.name, rank)
        extra = self._per_rank_kwargs[rank] if self._per_rank_kwargs else {}
        return _actor_class(self._cls).options(
            **resources, max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(device.node_id, soft=False),
        ).remote(
            rank=rank, world_size=len(self.processes), device_kind=plan.device_kind, torch_threads=self._threads,
            local_device=device.local_index, pin_cpu=plan.pin_cpus, **self._kwargs, **extra,
        )

    def __len__(self) -> int:
        return len(self.workers)

    def call_async(self, method: str, *args: Any, per_rank_args: list[tuple] | None = None,
                   **kwargs: Any) -> list:
        """Start ``method`` on every rank; returns their ObjectRefs.

        ``per_rank_args[i]`` (if given) is appended to ``args`` for rank ``i``.
        """
        refs = []
        for rank, worker in enumerate(self.workers):
            extra = per_rank_args[rank] if per_rank_args else ()
            refs.append(getattr(worker, method).remote(*args, *extra, **kwargs))
        return refs

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method`` on every rank and wait; returns the results in rank order."""
        return self.get(self.call_async(method, *args, **kwargs), f"{self.name}.{method}")

    def kill(self, rank: int) -> None:
        """End rank ``rank``'s process, whatever state it is in (a stopped process too)."""
        import ray

        process = self.processes[rank]
        if process is not None and process.node_id == _this_node():
            # its simulator processes first (a stopped one would never exit), then itself: Ray asks
            # the process to exit first, which a stopped or hung one never does
            for pid in [*_descendants(process.pid), process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        ray.kill(self.workers[rank], no_restart=True)

    def replace(self, rank: int) -> None:
        """Kill rank ``rank`` and start a new process in its place, built as the first was."""
        self.kill(rank)
        self.processes[rank] = None
        self.workers[rank] = self._start(rank)
        wait_ready(self)

    def restart(self) -> None:
        """Replace every rank (a group whose ranks hold shared state: data-parallel actor ranks)."""
        for rank in range(len(self.workers)):
            self.kill(rank)
            self.processes[rank] = None
        self.workers = [self._start(rank) for rank in range(len(self.workers))]
        wait_ready(self)

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def _ray_get(refs: list, what: str) -> list:
    import ray

    return ray.get(refs)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def wait_ready(*groups: WorkerGroup) -> None:
    """Wait until every worker of ``groups`` is constructed (groups started with ``wait=False``
    come up side by side), and note where each runs; fail here, with the worker's own error, if
    a constructor raised. A rank still starting after its group's ``start_deadline_s`` is killed
    and raised as a :class:`WorkerFailure` naming it ``hung`` (what the runner recovers from)."""
    import ray

    pending = {group.workers[rank].process.remote(): (group, rank) for group in groups
               for rank in range(len(group.workers)) if group.processes[rank] is None}
    started = time.monotonic()
    while pending:
        elapsed = time.monotonic() - started
        late = [(group, rank) for group, rank in pending.values() if elapsed >= group.start_deadline_s]
        if late:
            raise _start_failure(late)
        wait_s = min(group.start_deadline_s for group, _ in pending.values()) - elapsed
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s, fetch_local=False)
        for ref in ready:
            group, rank = pending.pop(ref)
            group.processes[rank] = ray.get(ref)  # a constructor's error surfaces here, as Ray reports it


def _start_failure(late: list[tuple[WorkerGroup, int]]) -> WorkerFailure:
    """Kill the ranks whose constructors outlived their deadline (a hung one would hold its slot
    and could still come up later, unseen) and name them as hung."""
    faults = []
    for group, rank in late:
        group.kill(rank)
        node = group._plan.device(group.name, rank).node_id
        faults.append(WorkerFault(
            group.name, rank, "hung", f"{group.name} start-up",
            f"its constructor did not return within the start-up deadline of {group.start_deadline_s:g} s; "
            "find where it waits in its log lines (a simulator or device that never comes up, a download), "
            "or raise runner.first_call_deadline_s if starting is legitimately that slow", node_id=node))
    call = " and ".join(dict.fromkeys(group.name for group, _ in late)) + " start-up"
    return WorkerFailure(call, faults, "a worker did not start in time")
