"""``embodied eval [checkpoint=<run_dir|file.pt>] [overrides]``: the env's evaluation protocol
(per-task table, eval.json, videos); ``embodied evals <run_dir>``: every evaluation of a run's
checkpoints, oldest first, to compare them.

Without a checkpoint ``eval`` scores the policy as built (``policy=random``: the random baseline;
``policy.vla.model_path``: a public checkpoint). Results go to a new directory, made only once the
episodes have run, so an evaluation stopped early leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from embodied.commands.common import (
    checkpointed,
    composed_overrides,
    config_command,
    out_dir,
    printed_job_config,
    run_protocol,
)
from embodied.config import to_yaml
from embodied.provenance import provenance
from envs.common import UserError
from envs.registry import check_env_config, seed_scheme


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``eval`` (the config flags and overrides) and ``evals`` (one run directory, no flags)."""
    config_command(subparsers, "eval", "the env's evaluation protocol: per-task table, JSON, videos", __doc__, run,
                   "checkpoint=<run_dir|file.pt> evaluates those weights with their run's config")
    evals = subparsers.add_parser("evals", help="the evaluations of a run's checkpoints, oldest first",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    evals.add_argument("run_dir", nargs="?", help="the training run directory (`embodied train`'s last line)")
    evals.set_defaults(run=run_evals)


def run(args: argparse.Namespace) -> int:
    """``eval``, or with ``--cfg job`` the config it would evaluate with (a checkpoint's own, overridden)."""
    overrides = composed_overrides(args)
    if printed_job_config(args, lambda: checkpointed(overrides)[0]):
        return 0
    return evaluate(overrides)


def evaluate(overrides: list[str]) -> int:
    """Run the env backend's evaluation protocol; without a checkpoint, the policy as built
    (``policy=random``: the random baseline). Writes eval.json, eval.md, config.yaml and videos/."""
    from embodied.checkpoint import atomic_write
    from embodied.evaluate import summarize, video_episodes, write_eval, write_videos
    from embodied.run_dirs import check_claimable, index_evaluation, protocol_digest, run_of_checkpoint, written_whole

    cfg, state, path = checkpointed(overrides)
    check_env_config(cfg.env)
    seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    digest = protocol_digest(cfg.eval, cfg.env, seeds)
    record = video_episodes(seeds, cfg.env, cfg.eval.videos_per_task)
    if state is None and not cfg.policy.vla.model_path:
        print(f"note: no checkpoint given: evaluating policy={cfg.policy.name} as initialised", file=sys.stderr)
    check_claimable(cfg.runner.run_dir, "this eval")
    t0 = time.perf_counter()
    rows, videos, env_steps = run_protocol(cfg, state["actor"] if state else None, seeds, record)
    summary = summarize(rows, cfg.env, cfg.eval.tasks)
    wall_s = time.perf_counter() - t0
    summary.update(checkpoint=str(path) if path else None, policy=cfg.policy.name, wall_s=wall_s,
                   env_steps=env_steps, env_steps_per_s=env_steps / wall_s, num_envs=cfg.env.num_envs,
                   provenance=provenance(cfg, path))
    # the directory is made only now, and filled whole: an evaluation stopped earlier leaves nothing
    results = out_dir(cfg, path, "evals", f"{path.stem if path else 'untrained'}-{digest}")
    with written_whole(results) as staging:
        atomic_write(staging / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))  # what ran, every key
        table = write_eval(staging, summary)
        write_videos(staging / "videos", videos, rows, cfg.env)
    run = run_of_checkpoint(path) if path else None
    if run is not None:
        index_evaluation(run, results, summary, "eval", str(path), digest)
    print(table)
    print(f"{len(rows)} episodes in {wall_s:.0f} s ({env_steps / wall_s:.1f} env-steps/s with "
          f"{cfg.env.num_envs} envs); {len(videos)} videos in {results / 'videos'}")
    print(results.resolve())
    return 0


def run_evals(args: argparse.Namespace) -> int:
    """``embodied evals <run_dir>``: the run's evaluation index as a table, oldest first."""
    from embodied.run_dirs import read_index

    if args.run_dir is None or not (Path(args.run_dir) / "config.yaml").exists():
        given = [args.run_dir] if args.run_dir is not None else []
        raise UserError(f"embodied evals needs one training run directory (with a config.yaml), got {given}: "
                        "pass the directory `embodied train` printed as its last line.")
    print("| time | kind | checkpoint | protocol | episodes | success_once | success_at_end | return_mean | path |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for e in read_index(Path(args.run_dir)):
        print(f"| {e['time']} | {e['kind']} | {Path(e['checkpoint']).name} | {e['protocol']} | {e['episodes']} | "
              f"{e['success_once']:.3f} | {e['success_at_end']:.3f} | {e['return_mean']:.2f} | {e['path']} |")
    return 0
