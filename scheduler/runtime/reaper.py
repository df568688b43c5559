"""A run's local Ray cluster ends with the run, however its driver ends (SIGKILL included).

Ray starts gcs_server and the raylet with ``PR_SET_PDEATHSIG``, so they die with the driver,
and its workers leave once the raylet is gone. The raylet's own children do not:
``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` log "Raylet is dead! Exiting", then hang on
the way out, under PID 1, catching SIGTERM without acting on it. So :func:`start_cluster
<scheduler.runtime.cluster.start_cluster>` starts this reaper first: a small process, in a
session of its own (a Ctrl-C at the terminal does not reach it; the driver's does), that waits
for the driver to end, then sends SIGTERM to every process of the run's cluster and SIGKILL to
those still there ``grace`` seconds later.

A process of the run's cluster is one that carries the run's token in its environment
(``EMBODIED_RAY_RUN``, set before ``ray.init``: gcs_server, the raylet, the workers and what they
start, e.g. simulator processes, inherit it) or has a file open in the cluster's session
directory open for writing (Ray's processes all log there; the agents need this: their process
titles overwrite the environment that /proc shows; a ``tail -f`` of a log only reads it).
Another run's cluster has another token and session, and a cluster joined with ``ray.address``
was started by someone else: it gets no reaper.
:meth:`Reaper.stop` (after ``ray.shutdown()``) ends the reaper while the driver lives on; it then
ends only such processes that are no longer the driver's descendants (Ray's leftovers: a
subprocess of the driver that inherited the token is the driver's own business).

This file is run as a script (``python reaper.py <driver pid> <token> <grace s>``) and imports
nothing but the standard library. Its stdin is a pipe from the driver: ``session <dir>`` names the
cluster's session directory (its ``logs/embodied_reaper.log`` says what the reaper did), ``stop`` is
:meth:`Reaper.stop`; the end of the pipe without ``stop``, or the driver's pidfd becoming readable,
is the driver's end.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

RUN_VAR = "EMBODIED_RAY_RUN"
GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later (the agents never leave on SIGTERM)


def new_token() -> str:
    return uuid.uuid4().hex


class Reaper:
    """The driver's handle on its reaper process."""

    def __init__(self, popen: subprocess.Popen, token: str):
        self.popen, self.token = popen, token

    def _send(self, line: str) -> None:
        try:
            self.popen.stdin.write(line.encode() + b"\n")
            self.popen.stdin.flush()
        except (OSError, ValueError):
            pass  # the reaper is gone already

    def watch_session(self, session_dir: str) -> None:
        self._send(f"session {session_dir}")

    def stop(self, timeout: float = GRACE_S + 10) -> None:
        """The cluster was shut down: end its leftovers (not the driver's own children), and exit."""
        self._send("stop")
        try:
            self.popen.stdin.close()
        except OSError:
            pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def start(token: str, grace: float = GRACE_S) -> Reaper:
    """Start the reaper of this (the driver) process's cluster: the processes that carry
    ``RUN_VAR=token`` and, once :meth:`Reaper.watch_session` named it, write in its session directory."""
    env = {k: v for k, v in os.environ.items() if k != RUN_VAR}
    popen = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), token,
                              str(grace)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env)
    return Reaper(popen, token)


# -- the reaper process ----------------------------------------------------------------------------
def _has_token(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")  # a zombie's reads empty: nothing to end
    except OSError:  # gone, or another user's
        return False


def _writes_in(pid: str, session_dir: str) -> bool:
    """Whether process ``pid`` has a file in ``session_dir`` open for writing (as Ray's processes
    have their logs; a ``tail -f`` of one, or an editor, reads)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(session_dir):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration, ValueError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def members(token: str, session_dir: str | None, spare: set[int] = frozenset()) -> list[int]:
    """The pids of the run's cluster's live processes (this process and ``spare`` aside): those with
    ``RUN_VAR=token`` in their environment or a file in ``session_dir`` open for writing."""
    needle = f"{RUN_VAR}={token}".encode()
    session = os.path.join(os.path.realpath(session_dir), "") if session_dir else None
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or int(entry) in spare:
            continue
        if _has_token(entry, needle) or (session is not None and _writes_in(entry, session)):
            found.append(int(entry))
    return found


def descendants(root: int) -> set[int]:
    """``root``'s live descendants (by /proc/<pid>/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")[:60] or "?"
    except OSError:
        return "?"


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def reap(token: str, session_dir: str | None, grace: float, spare: set[int] = frozenset(),
         log=lambda line: None) -> list[int]:
    """SIGTERM to the run's cluster's processes (:func:`members`), SIGKILL to those left after
    ``grace`` s; returns the pids signalled."""
    found = members(token, session_dir, spare)
    if not found:
        return []
    log(f"SIGTERM to {len(found)}: " + ", ".join(f"{pid} {_name(pid)}" for pid in found))
    signalled = set(found)
    _signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.2)
        found = members(token, session_dir, spare)
        if not found:
            return sorted(signalled)
        _signal_all([pid for pid in found if pid not in signalled], signal.SIGTERM)  # one started meanwhile
        signalled.update(found)
    for _ in range(20):
        found = members(token, session_dir, spare)
        if not found:
            break
        log(f"SIGKILL to {len(found)}: " + ", ".join(f"{pid} {_name(pid)}" for pid in found))
        signalled.update(found)
        _signal_all(found, signal.SIGKILL)
        time.sleep(0.2)
    return sorted(signalled)


def _wait(driver: int, sessions: list[str]) -> bool:
    """Block until the driver ends (True) or says ``stop`` (False); ``session <dir>`` lines go to ``sessions``."""
    stdin = sys.stdin.fileno()
    try:
        pidfd = os.pidfd_open(driver)
    except (AttributeError, OSError):
        pidfd = None  # no pidfds (Linux < 5.3): the pipe, and the parent pid every second
    if os.getppid() != driver:  # it ended before we looked (or the pidfd is another process's)
        return True
    poller = select.poll()
    poller.register(stdin, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    pending, listening = b"", True
    while True:
        ready = {fd for fd, _ in poller.poll(None if pidfd is not None else 1000)}
        while listening and stdin in ready:  # what the driver said before it ended, too
            data = os.read(stdin, 4096)
            if not data:  # closed without "stop": the driver ends (its interpreter may still be finalizing)
                poller.unregister(stdin)
                listening = False
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                word, _, arg = line.decode().partition(" ")
                if word == "stop":
                    return False
                if word == "session":
                    sessions.append(arg)
            ready = {fd for fd, _ in poller.poll(0)}
        if pidfd in ready or (pidfd is None and os.getppid() != driver):
            return True


def main(argv: list[str]) -> int:
    driver, token, grace = int(argv[1]), argv[2], float(argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sessions: list[str] = []
    ended = _wait(driver, sessions)
    session_dir = sessions[-1] if sessions else None

    def log(line: str) -> None:
        if session_dir is not None:
            try:
                with open(os.path.join(session_dir, "logs", "embodied_reaper.log"), "a") as f:
                    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} reaper of driver {driver}: {line}\n")
            except OSError:
                pass

    if ended:
        # the driver's pid aside: the pipe ends as its interpreter finalizes, with Ray's logs still open
        reap(token, session_dir, grace, spare={driver}, log=lambda line: log(f"the driver is gone; {line}"))
    else:  # ray.shutdown() ran: the driver and its own children live on
        reap(token, session_dir, grace, spare=descendants(driver) | {driver},
             log=lambda line: log(f"after ray.shutdown(); {line}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
