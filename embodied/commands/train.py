"""``embodied train [overrides]``: train, evaluate with the env's protocol, print the run directory last.

``resume=<run_dir>`` continues a stopped or killed run from its saved config and newest checkpoint that
verifies (``resume=<run_dir>/checkpoints/ckpt_<iteration>.pt``: from that one);
``checkpoint=<run|file.pt>`` warm-starts from another run (e.g. an SFT run), training that run's env
and policy config. :func:`train_once` is the one "train a run" path: ``embodied chaos`` calls it too,
with its fault injector running alongside, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from embodied import run_owner
from embodied.commands.common import (
    checkpointed,
    composed_overrides,
    config_command,
    config_from_saved,
    printed_job_config,
    removed_if_failed_empty,
    split_override,
)
from embodied.config import TrainConfig
from embodied.provenance import provenance
from envs.common import UserError
from envs.registry import seed_scheme

if TYPE_CHECKING:
    from embodied.trainer import Trainer

HELP = "train; the last line printed is the run directory"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``train``: the config flags and overrides (plus ``resume=`` / ``checkpoint=``), nothing else."""
    config_command(subparsers, "train", HELP, __doc__, run,
                   "resume=<run_dir> continues a run; checkpoint=<run_dir|file.pt> warm-starts from one")


def run(args: argparse.Namespace) -> int:
    """Train one run (``--cfg job``: print its config, resolved as the run would, and stop)."""
    start = prepare(composed_overrides(args))
    if printed_job_config(args, lambda: start.cfg):  # resume= reloads a saved config: print what runs
        return 0
    run_dir, _ = train_once(start)
    print(run_dir.resolve())
    return 0


@dataclass
class Start:
    """What a training run starts from: its config, and the state of a resumed or warm-started run."""

    cfg: TrainConfig
    resumed: bool = False  # continue cfg.runner.run_dir (resume=): no new directory is claimed
    resume_state: dict | None = None
    warm: dict | None = None  # the state of checkpoint=: its weights start the run


def prepare(overrides: list[str]) -> Start:
    """Resolve ``overrides`` into the config a run trains, refusing what cannot train (the random
    baseline, a policy without trainable weights) before anything starts."""
    from policies.registry import check_trainable

    resume, rest = split_override(overrides, "resume")
    if resume:
        run_dir, resume_state = resume_point(resume)
        cfg = config_from_saved((run_dir / "config.yaml").read_text(), rest)
        cfg.runner.run_dir = str(run_dir)
        start = Start(cfg, resumed=True, resume_state=resume_state)
    else:
        # a warm start (checkpoint=, e.g. an SFT run) trains the checkpoint's env and policy config
        cfg, warm, ckpt_path = checkpointed(rest)
        if ckpt_path is not None:
            cfg.checkpoint = str(ckpt_path)
        start = Start(cfg, warm=warm)
    check_trainable(start.cfg.policy)
    return start


def resume_point(resume: str) -> tuple[Path, dict]:
    """``resume=``: the run directory and the state it goes on from, with the run held by this process.
    A directory goes on from its newest checkpoint that verifies and reads; a checkpoint file of the run
    from that file. Checkpoints passed over (damaged, or newer than the file named) and a ``best.pt`` of
    a later history are moved to ``checkpoints/<why>-<time>/``, kept, and named on stderr."""
    from embodied.checkpoint import (
        BEST,
        checkpoints_of,
        load_checkpoint,
        newest_checkpoint,
        point_latest_at,
        read_verified,
        set_aside,
    )
    from embodied.run_dirs import run_of_checkpoint

    given = Path(resume).expanduser()
    run_dir = run_of_checkpoint(given) if given.is_file() else given
    if run_dir is None or not (run_dir / "config.yaml").exists():
        raise UserError(f"resume={resume}: no training run there (no config.yaml). Pass the run directory that "
                        "`embodied train` printed as its last line, or one of its checkpoints/ckpt_<iteration>.pt.")
    note = run_owner.take(run_dir, "this resume")
    if note:
        print(f"note: {note}", file=sys.stderr)
    if given.is_file():
        chosen, state = given, load_checkpoint(given)
        passed = {p: "newer than the checkpoint resumed" for p in checkpoints_of(run_dir) if p.name > given.name}
        why = f"after-{given.stem}"
    else:
        chosen, state, skipped = newest_checkpoint(run_dir)
        passed, why = {s.path: s.reason for s in skipped}, "broken"
    best = run_dir / "checkpoints" / BEST
    if best.exists() and _best_of_another_history(best, state, read_verified):
        passed[best] = "the best validation of iterations after the one resumed"
    kept = set_aside(list(passed), run_dir, why)
    point_latest_at(chosen)
    for path, reason in passed.items():
        print(f"note: resume: passed over {path.name} ({reason}); kept in {kept}", file=sys.stderr)
    print(f"note: resuming {run_dir} from {chosen.name} (iteration {state['progress']['iteration']})", file=sys.stderr)
    return run_dir, state


def _best_of_another_history(best: Path, state: dict, read: Callable[[Path], dict]) -> bool:
    """Whether ``best.pt`` holds weights the resumed state never had (a validation after it), or cannot be read."""
    try:
        best_iteration = read(best)["progress"]["best_iteration"]
    except Exception:
        return True
    return best_iteration != state["progress"]["best_iteration"]


def train_once(start: Start, alongside: Callable[[Trainer], AbstractContextManager[object]] | None = None
               ) -> tuple[Path, dict]:
    """Train ``start`` to its end and write its final evaluation (eval.json / eval.md, the index,
    videos); print the table and a summary line. ``alongside(trainer)`` is entered for the training
    itself (``embodied chaos``: its fault injector), and left before the results are written.
    Returns ``(run directory, evaluation summary)``."""
    from embodied.checkpoint import BEST, resolve_checkpoint
    from embodied.evaluate import write_eval, write_videos
    from embodied.run_dirs import claim_dir, file_away_final_eval, index_evaluation, protocol_digest
    from embodied.trainer import Trainer

    cfg = start.cfg
    if start.resumed:
        run_dir = Path(cfg.runner.run_dir)
    else:
        run_dir = claim_dir(cfg.runner.run_dir, Path("runs"), f"{cfg.env.task}-{cfg.policy.name}", "this training")
        cfg.runner.run_dir = str(run_dir)
    with removed_if_failed_empty(run_dir):
        trainer = Trainer(cfg, run_dir, resume_from=start.resume_state, warm_start=start.warm)
    try:
        with alongside(trainer) if alongside is not None else contextlib.nullcontext():
            summary = trainer.train()
        file_away_final_eval(run_dir)  # a resumed run's earlier final evaluation is kept, not replaced
        seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
        evaluated = (run_dir / "checkpoints" / BEST if summary["evaluated"]["weights"] == "best"
                     else resolve_checkpoint(run_dir))
        # what was evaluated, as `embodied eval` records it: the checkpoint and its digest, the code, the versions
        summary.update(checkpoint=str(evaluated), policy=cfg.policy.name, provenance=provenance(cfg, evaluated))
        table = write_eval(run_dir, summary)
        index_evaluation(run_dir, run_dir, summary, "train", str(evaluated), protocol_digest(cfg.eval, cfg.env, seeds))
        write_videos(run_dir / "videos", trainer.final_videos, summary["rows"], cfg.env)  # filmed during the eval
    finally:
        trainer.close()
    t, weights = summary["training"], summary["evaluated"]
    print(table)
    print(f"trained {t['env_steps']} env steps in {t['train_minutes']:.1f} min "
          f"({t['env_steps_per_s']:.0f} env-steps/s); eval of the {weights['weights']} weights (iteration "
          f"{weights['iteration']}) over {summary['episodes']} episodes: success_once {summary['success_once']:.3f}")
    return run_dir, summary
