"""Checkpoints: one schema (:func:`checkpoint_state`), written atomically so a crash (even
SIGKILL) mid-save never leaves a corrupt or missing one.

Files: ``<run_dir>/checkpoints/ckpt_<iteration>.pt`` (the newest ``runner.keep_checkpoints``), ``latest.json``
naming the newest and, with ``runner.eval_every``, ``best.pt`` (the best validation's weights). Each is written to a
temporary file, fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import os
import tempfile
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


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep: int) -> Path:
    """Write ``ckpt_<iteration>.pt`` and point ``latest.json`` at it; then delete all but the newest
    ``keep`` checkpoints (``runner.keep_checkpoints``), only once the new one is safely written."""
    if keep < 1:
        raise ValueError(f"keep={keep}: a run keeps at least the checkpoint it just wrote")
    ckpt_dir = Path(run_dir) / "checkpoints"
    path = ckpt_dir / f"ckpt_{iteration:06d}.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write(ckpt_dir / "latest.json", lambda f: f.write(json.dumps({"file": path.name}).encode()))
    for old in sorted(ckpt_dir.glob("ckpt_*.pt"))[:-keep]:
        old.unlink()
    return path


def save_best_checkpoint(run_dir: Path, state: dict) -> Path:
    """``<run_dir>/checkpoints/best.pt``: the weights of the best periodic validation so far.
    Never pruned, and not what a run directory resolves to (that stays the newest)."""
    path = Path(run_dir) / "checkpoints" / BEST
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory (-> its newest checkpoint)."""
    path = Path(path).expanduser()
    if path.is_dir():
        ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        latest = ckpt_dir / "latest.json"
        if latest.exists():
            candidate = ckpt_dir / json.loads(latest.read_text())["file"]
            if candidate.exists():
                return candidate
        found = sorted(ckpt_dir.glob("ckpt_*.pt"))
        if found:
            return found[-1]
        raise UserError(f"No checkpoint in {path}: expected {ckpt_dir}/ckpt_*.pt written by `embodied train`. "
                        "Pass checkpoint=<file.pt> or a run directory that has trained for at least "
                        "runner.checkpoint_every iterations.")
    if not path.exists():
        raise UserError(f"Checkpoint not found: {path}. Pass checkpoint=<run_dir> (its newest checkpoint is "
                        "used) or checkpoint=<run_dir>/checkpoints/ckpt_<iteration>.pt.")
    return path


def load_checkpoint(path: str | Path) -> dict:
    path = resolve_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise UserError(f"Checkpoint {path} could not be read ({type(err).__name__}: {err}). "
                        "Pass another checkpoint from the same run's checkpoints/ folder.") from None
