"""One owner per output directory: the command writing a run (``train``, ``resume=``, ``sft``) or results
(``eval``, ``record`` with ``runner.run_dir``) takes it before anything else starts, and a second command
on the same directory is refused at once, naming the owner.

The lock is an ``flock`` on the directory itself, which the OS releases when its process ends however it
ends (SIGKILL included), so a dead owner never strands a directory. Beside it, ``<dir>/.owner.json`` says
who holds it (pid, host, command, since): written when taken, removed when released. Finding that file
with the lock free means its owner died without releasing: the lock is taken over and the run log says so.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from envs.common import UserError

OWNER_FILE = ".owner.json"


@dataclass
class Ownership:
    """A directory this process holds: the open descriptor its lock lives on, and whether we made it."""

    path: Path
    fd: int
    created: bool


_held: dict[Path, Ownership] = {}  # resolved path -> ownership, for this process's lifetime


def take(path: Path, what: str, created: bool | None = None) -> str | None:
    """Make ``path`` (if needed) and hold it for this process until :func:`release` or exit.
    Re-taking a directory this process holds is a no-op. ``what`` ("this training") names the
    command in the refusal; ``created``: whether the caller just made it (default: whether it is
    made now). Returns a note if a dead owner's lock was taken over, else None.
    Raises :class:`UserError` if another live process holds it."""
    path = Path(path)
    key = path.resolve()
    if key in _held:
        return None
    created = not path.exists() if created is None else created
    path.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(_in_use(path, what)) from None
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the directory was removed and made again while we locked it: lock the new one
    note = _taken_over_note(path)
    _write_owner(path)
    _held[key] = Ownership(path, fd, created)
    return note


def release(path: Path) -> None:
    """Give ``path`` up: remove the owner file, unlock, and remove the directory if this process made
    it and left it empty (a command that failed before writing anything)."""
    held = _held.pop(Path(path).resolve(), None)
    if held is None:
        return
    with contextlib.suppress(FileNotFoundError):
        (held.path / OWNER_FILE).unlink()
    os.close(held.fd)  # closing the last descriptor releases the flock
    if held.created:
        with contextlib.suppress(OSError):
            held.path.rmdir()  # only if empty


def holds(path: Path) -> bool:
    return Path(path).resolve() in _held


def owner_of(path: Path) -> dict | None:
    """What ``<path>/.owner.json`` says (None if absent or unreadable)."""
    try:
        return json.loads((Path(path) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None


def describe_owner(owner: dict | None) -> str:
    if owner is None:
        return "another process (it has not written its .owner.json yet)"
    return (f"pid {owner.get('pid')} on {owner.get('host')} (`{owner.get('command')}`, since "
            f"{owner.get('since')})")


def _in_use(path: Path, what: str) -> str:
    return (f"{path} is in use by {describe_owner(owner_of(path))}: {what} would write into the same directory "
            "and mix the two commands' files. Wait for that command to end (or stop it), name another "
            "directory with runner.run_dir, or leave runner.run_dir unset for a fresh one.")


def _taken_over_note(path: Path) -> str | None:
    owner = owner_of(path)
    if owner is None:
        return None
    return (f"{path} was held by {describe_owner(owner)}, which ended without releasing it (killed?): "
            "taken over")


def _write_owner(path: Path) -> None:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
             "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = path / f"{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(owner) + "\n")
    os.replace(tmp, path / OWNER_FILE)


@atexit.register
def release_all() -> None:
    for key in list(_held):
        release(key)
