"""Checkpoints: one schema (:func:`checkpoint_state`), written atomically so a crash (even
SIGKILL) mid-save never leaves a corrupt or missing one.

Files: ``<run_dir>/checkpoints/ckpt_<iteration>.pt`` (the newest ``runner.keep_checkpoints``), ``latest.json``
naming the newest and, with ``runner.eval_every``, ``best.pt`` (the best validation's weights). Each is written to a
temporary file, fsynced, then renamed into place, with its SHA-256 beside it (``ckpt_<iteration>.pt.sha256``, the
format ``sha256sum -c`` reads). A run directory resolves to its newest checkpoint that verifies: one damaged
afterwards (a full disk, a copy cut short) is passed over and named, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from envs.common import UserError

BEST = "best.pt"  # runner.final_weights=best: the best periodic validation's weights


@dataclass
class Progress:
    """Counters saved in every checkpoint so a resumed run continues where it stopped."""

    iteration: int = 0
    env_steps: int = 0
    train_seconds: float = 0.0  # wall-clock of the training loop (evals and checkpoints included)
    solved_at_seconds: float | None = None  # first periodic eval with success_once >= runner.solved_success
    best_eval_success: float | None = None  # the best periodic eval's success_once (checkpoints/best.pt)
    best_iteration: int | None = None  # ... and the iteration it followed


def checkpoint_state(actor: dict, progress: Progress, config_yaml: str, obs_spec: dict, action_dim: int,
                     **extra) -> dict:
    """The one checkpoint schema, a dict saved with ``torch.save``, that ``train`` (``resume=``,
    ``checkpoint=`` warm starts), ``eval`` and ``record`` read:

    - ``actor``: the ActorWorker's state (``policy`` weights; ``optimizer``, ``generator``,
      ``torch_rng`` and the KL ``reference`` where training has them);
    - ``progress``: :class:`Progress` as a dict;
    - ``config_yaml``: the run's whole config (``embodied.config.to_yaml``);
    - ``obs_spec`` / ``action_dim``: what the policy was built for;
    - ``extra``: what a command adds (``sft``: its statistics).
    """
    return {"actor": actor, "progress": asdict(progress), "config_yaml": config_yaml, "obs_spec": obs_spec,
            "action_dim": action_dim, **extra}


def atomic_write(path: Path, write) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` into a temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a checkpoint is meant to be shared
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _Hashing:
    """A file object that hashes what is written through it (``torch.save`` writes its zip sequentially)."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checksum_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".sha256")


def save_verified(path: Path, state: dict) -> Path:
    """``torch.save(state)`` to ``path`` atomically, then its SHA-256 to ``<path>.sha256``."""
    digest = {}

    def write(f) -> None:
        hashing = _Hashing(f)
        torch.save(state, hashing)
        digest["hex"] = hashing.sha256.hexdigest()

    atomic_write(path, write)
    atomic_write(checksum_path(path), lambda f: f.write(f"{digest['hex']}  {path.name}\n".encode()))
    return path


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` does not verify against the SHA-256 written beside it, or None if it does (or has
    none: checkpoints written before checksums are checked by reading them)."""
    sidecar = checksum_path(path)
    if not sidecar.exists():
        return None
    expected = sidecar.read_text().split()[0]
    actual = file_sha256(path)
    if actual == expected:
        return None
    return (f"its SHA-256 ({actual[:12]}...) is not the one written with it ({expected[:12]}...): the file "
            f"was changed or cut short after it was saved ({path.stat().st_size:,} bytes now)")


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep: int) -> Path:
    """Write ``ckpt_<iteration>.pt`` (and its checksum) and point ``latest.json`` at it; then delete all
    but the newest ``keep`` checkpoints (``runner.keep_checkpoints``), only once the new one is safely written."""
    if keep < 1:
        raise ValueError(f"keep={keep}: a run keeps at least the checkpoint it just wrote")
    ckpt_dir = Path(run_dir) / "checkpoints"
    path = save_verified(ckpt_dir / f"ckpt_{iteration:06d}.pt", state)
    point_latest_at(path)
    for old in sorted(ckpt_dir.glob("ckpt_*.pt"))[:-keep]:
        old.unlink()
        checksum_path(old).unlink(missing_ok=True)
    return path


def save_best_checkpoint(run_dir: Path, state: dict) -> Path:
    """``<run_dir>/checkpoints/best.pt``: the weights of the best periodic validation so far.
    Never pruned, and not what a run directory resolves to (that stays the newest)."""
    return save_verified(Path(run_dir) / "checkpoints" / BEST, state)


@dataclass
class Skipped:
    """A checkpoint a run directory did not resolve to, and why."""

    path: Path
    reason: str

    def describe(self) -> str:
        return f"{self.path.name}: {self.reason}"


def checkpoints_of(path: Path) -> list[Path]:
    """A run directory's (or a checkpoints folder's) ``ckpt_*.pt``, newest first."""
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return sorted(ckpt_dir.glob("ckpt_*.pt"), reverse=True)


def _no_checkpoint(path: Path, skipped: list[Skipped]) -> UserError:
    if skipped:
        named = "; ".join(s.describe() for s in skipped)
        return UserError(f"No checkpoint in {path} reads and verifies ({named}). The files are left as they are: "
                         "start a new run, or warm-start from another with checkpoint=<run_dir|file.pt>.")
    return UserError(f"No checkpoint in {path}: expected {path}/checkpoints/ckpt_*.pt written by `embodied train`. "
                     "Pass checkpoint=<file.pt> or a run directory that has trained for at least "
                     "runner.checkpoint_every iterations.")


def read_verified(path: Path) -> dict:
    """Load a checkpoint file after verifying its checksum; raises what went wrong (ValueError: the checksum)."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return torch.load(path, map_location="cpu", weights_only=False)


def newest_checkpoint(run_dir: Path) -> tuple[Path, dict, list[Skipped]]:
    """The newest checkpoint of ``run_dir`` that verifies and reads, its state, and the newer ones
    passed over (and why). Nothing is moved or deleted. Raises :class:`UserError` if none reads."""
    skipped: list[Skipped] = []
    for path in checkpoints_of(Path(run_dir)):
        try:
            return path, read_verified(path), skipped
        except Exception as err:  # a damaged file: torch's zip reader raises RuntimeError, pickle others
            skipped.append(Skipped(path, f"{type(err).__name__}: {err}"))
    raise _no_checkpoint(Path(run_dir), skipped)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory (-> its newest checkpoint that verifies, by checksum)."""
    path = Path(path).expanduser()
    if path.is_dir():
        skipped = []
        for candidate in checkpoints_of(path):
            problem = checkpoint_problem(candidate)
            if problem is None:
                return candidate
            skipped.append(Skipped(candidate, problem))
        raise _no_checkpoint(path, skipped)
    if not path.exists():
        raise UserError(f"Checkpoint not found: {path}. Pass checkpoint=<run_dir> (its newest checkpoint is "
                        "used) or checkpoint=<run_dir>/checkpoints/ckpt_<iteration>.pt.")
    return path


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint file's state, or a run directory's newest that reads (those passed over are named on stderr)."""
    path = Path(path).expanduser()
    if path.is_dir():
        found, state, skipped = newest_checkpoint(path)
        for s in skipped:
            print(f"note: passed over {s.describe()}; using {found.name}", file=sys.stderr)
        return state
    path = resolve_checkpoint(path)
    try:
        return read_verified(path)
    except Exception as err:
        raise UserError(f"Checkpoint {path} could not be read ({type(err).__name__}: {err}). "
                        "Pass another checkpoint from the same run's checkpoints/ folder.") from None


def set_aside(paths: list[Path], run_dir: Path, why: str) -> Path | None:
    """Move checkpoints (and their checksums) out of the way of a run that goes on from an older one, into
    ``<run_dir>/checkpoints/<why>-<time>/``: kept, never deleted, and never what the run resolves to or prunes."""
    if not paths:
        return None
    target = Path(run_dir) / "checkpoints" / f"{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=True)
    for path in paths:
        for file in (path, checksum_path(path)):
            if file.exists():
                os.replace(file, target / file.name)
    return target


def point_latest_at(path: Path) -> None:
    atomic_write(path.parent / "latest.json", lambda f: f.write(json.dumps({"file": path.name}).encode()))
