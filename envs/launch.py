"""Starting an env process of :class:`~envs.subproc.SubprocVecEnv`: by multiprocessing (this
interpreter), or by another Python interpreter for a simulator whose dependencies conflict with ours
(MetaWorld pins mujoco 3.3.0, LIBERO runs on 2.3.7: docs/design/metaworld.md).

Either way the caller gets a process handle with what SubprocVecEnv uses of
``multiprocessing.Process`` (``pid``, ``sentinel``, ``is_alive``, ``kill``, ``join``, ``exitcode``)
and a :class:`~multiprocessing.connection.Connection` to it, and the process runs
:func:`envs.subproc_child.serve`. multiprocessing's ``set_executable`` is no way to reach another
interpreter: its children install the parent's ``sys.path`` and import the parent's packages. So the
other interpreter is started with ``subprocess`` (``python -m envs.interpreter_child FD``), given one
end of a socket pair, and told what to serve over it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
from multiprocessing.connection import Connection
from pathlib import Path

from envs.subproc_child import serve

REPO_ROOT = Path(__file__).resolve().parents[1]


def interpreter_environment() -> dict[str, str]:
    """The environment another interpreter runs our modules in: ours, with the repository first on its path."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


class InterpreterProcess:
    """An env process run by another interpreter, as SubprocVecEnv sees a ``multiprocessing.Process``."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid
        # readable once the process exits: what multiprocessing.connection.wait watches beside the pipe
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; else its exit status (minus the signal that killed it, as multiprocessing's)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def __del__(self):
        try:
            os.close(self.sentinel)
        except (OSError, AttributeError):
            pass


def start_env_process(serve_args: tuple, python: str | None = None):
    """A process running ``serve(connection, *serve_args)``: forked from multiprocessing's forkserver
    (``python`` None), else started by the interpreter ``python``. Returns (process, connection)."""
    if python is None:
        # fork deadlocks inside lavapipe once the parent has built an env (docs/architecture.md, "Measured facts")
        ctx = mp.get_context("forkserver")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(child, *serve_args), daemon=True)
        proc.start()
        child.close()
        return proc, parent
    ours, theirs = socket.socketpair()
    popen = subprocess.Popen([python, "-m", "envs.interpreter_child", str(theirs.fileno())],
                             pass_fds=(theirs.fileno(),), env=interpreter_environment(), cwd=REPO_ROOT)
    theirs.close()
    connection = Connection(ours.detach())
    # the child answers ("ok", None) once its envs are built, ("error", traceback) if it cannot build them;
    # a child that cannot even start (a missing interpreter module) exits: its sentinel says so
    connection.send(serve_args)
    return InterpreterProcess(popen), connection
