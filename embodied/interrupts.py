"""Ctrl-C (SIGINT) during a command: the first one stops it in order, a second one at once.

The first Ctrl-C raises :class:`KeyboardInterrupt` where the main thread is, as Python's own
handler does, except inside :func:`finishing`: there it is held until the block ends (a training
iteration's update: a checkpoint taken while the actor still updates would hold the new weights
under the old iteration count). :meth:`Trainer.train <embodied.trainer.Trainer.train>` then
checkpoints and raises :class:`Interrupted`; ``embodied`` prints its one line and exits 130.

A second Ctrl-C exits 130 at once (``os._exit``: no clean-up; the local Ray cluster ends with the
process, :mod:`scheduler.runtime.reaper`), after one line from :func:`set_hint`'s hint.

Ray's own processes do not see a Ctrl-C at the terminal: gcs_server, the raylet and its agents
share the driver's process group but block SIGINT, and the workers run in process groups of
their own. They are alive to checkpoint from.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


class Interrupted(KeyboardInterrupt):
    """A run that Ctrl-C stopped in order; ``line`` says what it kept and how to go on."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class _State:
    def __init__(self) -> None:
        self.count = 0  # Ctrl-Cs seen
        self.holding = 0  # depth of finishing() blocks
        self.pending = False  # a Ctrl-C held by finishing()
        self.hint: Callable[[], str] | None = None


_state = _State()


def _say(line: str) -> None:
    os.write(2, f"\n{line}\n".encode())  # not print(): the main thread may be inside a write to stderr


def _on_sigint(signum, frame) -> None:
    _state.count += 1
    if _state.count > 1:
        hint = _hint()
        _say(f"Ctrl-C again: stopped at once{': ' + hint if hint else ''}")
        os._exit(EXIT_INTERRUPTED)
    if _state.holding:
        _state.pending = True
        _say("Ctrl-C: stopping after the update in flight (Ctrl-C again stops at once)")
        return
    _say("Ctrl-C: stopping (Ctrl-C again stops at once)")
    raise KeyboardInterrupt


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """This module's SIGINT handler while the block runs: in the main thread, where SIGINT has
    Python's own handler (inside another ``handled`` block, the outer one goes on)."""
    mine = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if mine:
        _state.__init__()
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _state.__init__()


def set_hint(hint: Callable[[], str]) -> None:
    """``hint()``: what is kept and how to go on (a run's newest checkpoint and ``resume=``), for a
    second Ctrl-C's line and :func:`stopped_line`; until the outermost :func:`handled` block ends."""
    _state.hint = hint


def _hint() -> str | None:
    try:
        return _state.hint() if _state.hint is not None else None
    except Exception:
        return None


def stopped_line(err: KeyboardInterrupt) -> str:
    """The one line for a command that a first Ctrl-C stopped."""
    if isinstance(err, Interrupted):
        return err.line
    hint = _hint()
    return f"interrupted: {hint}" if hint else "interrupted"


@contextlib.contextmanager
def finishing() -> Iterator[None]:
    """A first Ctrl-C during the block raises KeyboardInterrupt only once the block is done."""
    _state.holding += 1
    try:
        yield
    finally:
        _state.holding -= 1
    if not _state.holding and _state.pending:
        _state.pending = False
        raise KeyboardInterrupt
