"""Where a command writes: a directory nothing earlier lives in, and an index of a run's evaluations.

Layout of a training run ``D`` (docs/evaluation.md, "The run directory")::

    D/config.yaml, tb/, checkpoints/   the run (``resume=D`` continues it)
    D/eval.json, eval.md, videos/      its final evaluation (a resumed run files the earlier one under evals/)
    D/evals/index.jsonl                one line per evaluation of this run's checkpoints, oldest first
    D/evals/<checkpoint>-<protocol>-<time>/   what each ``embodied eval`` wrote
    D/records/<checkpoint>-<time>/     what each ``embodied record`` wrote

Every new directory is made with ``mkdir`` (never ``exist_ok``), so two commands started in
the same second, or at once, get two directories; a directory a command writes is held by it alone
(embodied/run_owner.py), so a second command naming the same ``runner.run_dir`` is refused. Files are
written whole (tmp + rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from embodied import run_owner
from embodied.checkpoint import atomic_write
from envs.common import UserError

# what marks a directory as holding a run or a command's results
RESULT_FILES = ("config.yaml", "eval.json", "checkpoints", "results.json")
INDEX = "index.jsonl"


def holds_results(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RESULT_FILES)


def make_unique_dir(parent: Path, name: str) -> Path:
    """``parent/name``, or ``name-2``, ``name-3``, ... if taken: created now, empty, ours alone."""
    parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 10_000):
        path = parent / (name if k == 1 else f"{name}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"{parent} has 10,000 directories named {name}-*: clean it up or pick runner.run_dir.")


@contextlib.contextmanager
def written_whole(final: Path) -> Iterator[Path]:
    """Yields a hidden sibling of ``final`` (an empty directory, just made) to write results into. When
    the block ends they become ``final``'s by one rename, so a reader sees all of them or none; a block
    that fails or is interrupted leaves neither directory behind."""
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        yield staging
        if any(final.iterdir()):  # a runner.run_dir the user made and put other files in: move ours in
            for entry in staging.iterdir():
                os.replace(entry, final / entry.name)
            staging.rmdir()
        else:
            os.replace(staging, final)  # a directory may replace an empty one: atomic on POSIX
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            final.rmdir()  # only if empty: never a user's files
        raise


def check_claimable(explicit: str | None, what: str) -> None:
    """Take ``runner.run_dir`` now, refusing it if another command holds it or it holds results
    (:func:`claim_dir` would, but only later: eval and record make their directory at the end)."""
    if explicit is not None:
        claim_dir(explicit, Path("runs"), "", what)


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def claim_dir(explicit: str | None, parent: Path, name: str, what: str) -> Path:
    """The directory a command writes, held by this process until it ends (embodied/run_owner.py):
    ``explicit`` (``runner.run_dir``) if given, refused if another command holds it or it already
    holds a run or results; else a new ``parent/name-<time>``."""
    if explicit is None:
        path = make_unique_dir(parent, f"{name}-{stamp()}")
        run_owner.take(path, what, created=True)
        return path
    path = Path(explicit)
    note = run_owner.take(path, what)  # first: from here on nobody else writes it
    if holds_results(path):
        run_owner.release(path)
        found = ", ".join(n for n in RESULT_FILES if (path / n).exists())
        raise UserError(f"runner.run_dir={explicit} already holds results ({found}): {what} would overwrite "
                        "them. Name a new directory, leave runner.run_dir unset (a fresh one is made), or "
                        "continue that training run with `embodied train resume=<dir>`.")
    if note:
        print(f"note: {note}", file=sys.stderr)
    return path


def run_of_checkpoint(checkpoint: Path) -> Path | None:
    """The training run a checkpoint file belongs to (``D/checkpoints/ckpt_*.pt`` -> ``D``), if any."""
    run = checkpoint.parent.parent
    return run if checkpoint.parent.name == "checkpoints" and (run / "config.yaml").exists() else None


def protocol_digest(eval_cfg, env_cfg, seeds: list[int]) -> str:
    """8 hex digits naming what an evaluation ran: its seeds and the settings that shape episodes."""
    settings = {"seeds": seeds, "deterministic": eval_cfg.deterministic, "reconfigure": eval_cfg.reconfigure,
                "task": env_cfg.task, "max_episode_steps": env_cfg.max_episode_steps,
                "obs_mode": env_cfg.obs_mode, "control_mode": env_cfg.control_mode}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def index_evaluation(run_dir: Path, out_dir: Path, summary: dict, kind: str, checkpoint: str | None,
                     digest: str) -> None:
    """Append one line to ``run_dir/evals/index.jsonl``: when, what was evaluated, on which
    protocol, the headline figures and where the files are. One ``write`` of one line in
    append mode: concurrent evaluations never interleave their lines."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "kind": kind, "checkpoint": checkpoint,
             "protocol": digest, "episodes": summary["episodes"], "success_once": summary["success_once"],
             "success_at_end": summary["success_at_end"], "return_mean": summary["return_mean"],
             "path": str(out_dir.resolve())}
    index = run_dir / "evals" / INDEX
    index.parent.mkdir(parents=True, exist_ok=True)
    with open(index, "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_index(run_dir: Path) -> list[dict]:
    index = Path(run_dir) / "evals" / INDEX
    return [json.loads(line) for line in index.read_text().splitlines()] if index.exists() else []


def file_away_final_eval(run_dir: Path) -> None:
    """A resumed run is about to write its final evaluation: move the earlier one (eval.json,
    eval.md, videos/) to ``evals/final-<its iteration>-<time>/`` instead of overwriting it, and
    point its index line there."""
    earlier = run_dir / "eval.json"
    if not earlier.exists():
        return
    iteration = json.loads(earlier.read_text()).get("evaluated", {}).get("iteration", "x")
    target = make_unique_dir(run_dir / "evals", f"final-{iteration}-{stamp()}")
    for name in ("eval.json", "eval.md", "videos"):
        if (run_dir / name).exists():
            (run_dir / name).rename(target / name)
    here, moved = str(run_dir.resolve()), str(target.resolve())
    entries = [{**e, "path": moved} if e["path"] == here else e for e in read_index(run_dir)]
    if entries:
        text = "".join(json.dumps(e) + "\n" for e in entries)
        atomic_write(run_dir / "evals" / INDEX, lambda f: f.write(text.encode()))
