"""``embodied chaos``: train while killing and stopping worker processes on a seeded schedule,
then report what the run survived.

    embodied chaos [train overrides] --faults 10 --chaos-seed 0 [--targets env,rollout,actor,simulator]
        [--signal mixed|kill|stop] [--busy-loops N] [--reference]

Each :class:`Injection` waits until training has completed ``iteration`` iterations, then
``delay_s`` more (so it lands mid-rollout or mid-update), and sends SIGKILL (``kill``: a worker
that dies) or SIGSTOP (``stop``: a worker that hangs) to one process of its target: an env,
rollout or actor worker, or a simulator process under an env worker (``env.num_procs > 0``).
The report matches each injection to the fault the run detected (by process id), with what it
cost. ``--reference`` then trains the same config without faults and compares the final
evaluations row by row: for GRPO, which starts every iteration from seeded resets, a redone
iteration is the iteration the fault broke, so the two runs can agree exactly; PPO's episodes
run across iterations, and a fault resets them, so its runs differ.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

TARGETS = ("env", "rollout", "actor", "simulator")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
GROUP_OF = {"env": "env", "rollout": "rollout", "actor": "actor", "simulator": "env"}  # who is replaced
STOP_SHARES = {"mixed": 0.25, "kill": 0.0, "stop": 1.0}  # --signal: the share of injections that SIGSTOP


@dataclass(frozen=True)
class Injection:
    iteration: int  # fire once training has completed this many iterations ...
    delay_s: float  # ... and this many seconds more
    target: str  # one of TARGETS
    rank: int  # which process of the target (modulo how many there are)
    how: str  # "kill" | "stop"


def draw_schedule(seed: int, faults: int, iterations: int, targets: tuple[str, ...] = TARGETS[:3],
                  stop_share: float = 0.25, max_delay_s: float = 3.0) -> list[Injection]:
    """``faults`` injections spread over iterations 2 .. 80% of ``iterations`` (distinct ones while
    there are enough), cycling through ``targets`` (shuffled per round) so each gets its share;
    ``stop_share`` of them SIGSTOP."""
    rng = random.Random(seed)
    span = range(2, max(2, int(0.8 * iterations)) + 1)
    at = sorted(rng.sample(span, faults) if faults <= len(span) else [rng.choice(span) for _ in range(faults)])
    order: list[str] = []
    while len(order) < faults:
        order += rng.sample(list(targets), len(targets))
    return [Injection(iteration, round(rng.uniform(0.2, max_delay_s), 2), target, rng.randrange(1 << 16),
                      "stop" if rng.random() < stop_share else "kill")
            for iteration, target in zip(at, order, strict=False)]


@dataclass
class Injected:
    """An injection as it was fired."""

    injection: Injection
    pid: int
    worker_pid: int  # the worker that owns the process (itself, or a simulator's env worker)
    unix_time: float
    iteration: int  # iterations completed when it fired


class ChaosMonkey(threading.Thread):
    """Fires a schedule of injections into a running :class:`~embodied.trainer.Trainer`."""

    def __init__(self, trainer, schedule: list[Injection], poll_s: float = 0.1, retry_s: float = 0.5):
        super().__init__(daemon=True, name="chaos")
        self.trainer, self.schedule, self.poll_s, self.retry_s = trainer, schedule, poll_s, retry_s
        self.fired: list[Injected] = []
        self.missed: dict[int, str] = {}  # schedule index -> why it never fired (the run ended first)
        self.done = threading.Event()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def _wait_until(self, ready) -> bool:
        while not ready():
            if self.done.wait(self.poll_s):
                return False
        return True

    def run(self) -> None:
        trainer = self.trainer
        for index, injection in enumerate(self.schedule):
            self.missed[index] = "the run ended before its iteration"
            if not self._wait_until(lambda i=injection: trainer.progress.iteration >= i.iteration
                                    and not trainer.recovery.recovering):
                return
            if self.done.wait(injection.delay_s):
                return
            # a target can be between lives (a worker being replaced, a simulator restarting): try again
            # until it fires, so a schedule is what the run gets, not what the timing allowed
            while not self.done.is_set():
                if self._wait_until(lambda: not trainer.recovery.recovering):
                    why = self._fire(injection)
                    if why is None:
                        del self.missed[index]
                        break
                    self.missed[index] = why
                self.done.wait(self.retry_s)
            if self.done.is_set():
                return

    def _fire(self, injection: Injection) -> str | None:
        """Signal the injection's process; None once sent, else why it could not be."""
        try:
            target = self._process(injection)
        except Exception as error:  # a worker that died or is busy past the timeout: its pid is not to be had
            return f"its process could not be found: {type(error).__name__}: {error}"
        if target is None:
            return f"no {injection.target} process was running"
        pid, owner = target
        try:
            os.kill(pid, SIGNALS[injection.how])
        except ProcessLookupError:
            return f"process {pid} had already ended"
        self.fired.append(Injected(injection, pid, owner, time.time(), self.trainer.progress.iteration))
        return None

    def _process(self, injection: Injection) -> tuple[int, int] | None:
        """(pid to signal, pid of the worker that owns it), or None if there is none."""
        import ray

        workers = self.trainer.workers
        group = workers.groups[GROUP_OF[injection.target]]
        ranks = [r for r, p in enumerate(group.processes) if p is not None]
        if not ranks:
            return None
        rank = ranks[injection.rank % len(ranks)]
        owner = group.processes[rank].pid
        if injection.target != "simulator":
            return owner, owner
        # simulator_pids answers on the worker's control threads, even mid-rollout
        sims = ray.get(group.workers[rank].simulator_pids.remote(), timeout=10)
        return (sims[injection.rank % len(sims)], owner) if sims else None


def report(fired: list[Injected], schedule: list[Injection], faults: dict,
           missed: dict[int, str] | None = None) -> dict:
    """Each injection matched to the fault the run recorded for its worker (by pid), with the other
    workers its recovery replaced (``others_replaced``; faults recorded that match no injection are
    ``collateral``); ``missed``: the scheduled injections that never fired, and why."""
    events = list(faults.get("events", []))
    rows = []
    for shot in fired:
        match = next((e for e in events if e["pid"] == shot.worker_pid), None)
        if match is not None:
            events.remove(match)
        others = [e for e in faults.get("events", []) if match is not None and e is not match
                  and e["recovery"] == match["recovery"]]
        rows.append({**asdict(shot.injection), "pid": shot.pid, "fired_at_iteration": shot.iteration,
                     "detected_as": match["kind"] if match else None, "call": match["call"] if match else None,
                     "action": match["action"] if match else None,
                     "recovery_s": match["recovery_s"] if match else None,
                     "iterations_lost": match["iterations_lost"] if match else 0,
                     "detected_after_s": round(match["detected_at"] - shot.unix_time, 1) if match else None,
                     "others_replaced": [f"{e['group']} {e['rank']} ({e['kind']})" for e in others]})
    return {"scheduled": len(schedule), "injected": len(fired), "detected": sum(r["detected_as"] is not None
                                                                              for r in rows),
            "faults_recorded": faults.get("count", 0), "collateral": len(events),
            "episodes_failed": faults.get("episodes_failed", 0), "iterations_lost": faults.get("iterations_lost", 0),
            "recovery_s": faults.get("recovery_s", 0.0), "injections": rows,
            "missed": [{**asdict(schedule[index]), "why": why} for index, why in sorted((missed or {}).items())]}


@contextlib.contextmanager
def cpu_contention(loops: int) -> Iterator[list[int]]:
    """``loops`` processes that spin (``while True: pass``) while the block runs, then are killed:
    CPU contention beside a run (a shared machine). Yields their pids."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        yield [p.pid for p in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def compare(chaos_rows: list[dict], reference_rows: list[dict]) -> dict:
    """How the chaos run's final evaluation differs from the fault-free run's, episode by episode."""
    same = sum(a["success_once"] == b["success_once"] and abs(a["return"] - b["return"]) < 1e-9
               for a, b in zip(chaos_rows, reference_rows, strict=True))
    mean = lambda rows: sum(float(r["success_once"]) for r in rows) / len(rows)  # noqa: E731
    return {"episodes": len(chaos_rows), "identical_episodes": same,
            "success_once": mean(chaos_rows), "reference_success_once": mean(reference_rows)}


def markdown(result: dict) -> str:
    lines = ["| # | at iteration | target | signal | pid | detected as | after (s) | during | action | "
             "others replaced | recovery (s) | iterations lost |",
             "|---:|---:|---|---|---:|---|---:|---|---|---|---:|---:|"]
    for k, r in enumerate(result["injections"]):
        recovery = f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else "-"
        after = f"{r['detected_after_s']:.0f}" if r.get("detected_after_s") is not None else "-"
        others = ", ".join(r.get("others_replaced", [])) or "none"
        lines.append(f"| {k} | {r['fired_at_iteration']} | {r['target']} | {r['how']} | {r['pid']} | "
                     f"{r['detected_as'] or 'not detected'} | {after} | {r['call'] or '-'} | {r['action'] or '-'} | "
                     f"{others} | {recovery} | {r['iterations_lost']} |")
    lines.append(f"\n{result['injected']} of {result['scheduled']} scheduled faults injected, {result['detected']} "
                 f"detected and survived; {result['faults_recorded']} faults recorded in all "
                 f"({result.get('collateral', 0)} of them on workers no injection hit), {result['iterations_lost']} "
                 f"iterations lost, {result.get('episodes_failed', 0)} episodes failed by error, "
                 f"{result['recovery_s']:.0f} s spent recovering.")
    for miss in result.get("missed", []):
        lines.append(f"- not injected: {miss['target']} {miss['how']} due at iteration {miss['iteration']}: "
                     f"{miss['why']}")
    if "reference" in result:
        ref = result["reference"]
        lines.append(f"Final evaluation: success_once {ref['success_once']:.3f} with faults, "
                     f"{ref['reference_success_once']:.3f} without; {ref['identical_episodes']} of "
                     f"{ref['episodes']} episodes identical.")
    return "\n".join(lines)
