"""``embodied record [checkpoint=<run_dir|file.pt>] [overrides]``: mp4 videos of the evaluation
protocol's episodes (no checkpoint: ``policy.vla.model_path``'s model, else uniform random actions).

A video is filmed through the evaluation's own path (the same workers, resets and noise), so it
shows exactly the episode ``embodied eval`` scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from embodied.commands.common import (
    checkpointed,
    composed_overrides,
    config_command,
    out_dir,
    printed_job_config,
    run_protocol,
)
from embodied.config import TrainConfig
from envs.registry import check_env_config, seed_scheme


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``record``: the config flags and overrides."""
    config_command(subparsers, "record", "mp4 videos of the protocol's episodes", __doc__, run,
                   "checkpoint=<run_dir|file.pt> films those weights with their run's config")


def run(args: argparse.Namespace) -> int:
    """``record``, or with ``--cfg job`` the config it would film with."""
    overrides = composed_overrides(args)
    if printed_job_config(args, lambda: checkpointed(overrides)[0]):
        return 0
    return record(overrides)


def record(overrides: list[str]) -> int:
    """Film ``eval.video_episodes`` of the protocol's episodes (each task's first, then the
    protocol's order) through the evaluation's own path: the same workers, resets and noise, so a
    video shows exactly the episode ``eval`` scores. Without a checkpoint: ``policy.vla.model_path``'s
    model as built (e.g. a public checkpoint), or with neither, uniform random actions."""
    from embodied.evaluate import recording_episodes, write_videos
    from embodied.run_dirs import check_claimable, written_whole

    cfg, state, path = checkpointed(overrides)
    check_env_config(cfg.env)
    protocol = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    seeds = [protocol[k] for k in recording_episodes(protocol, cfg.env, max(cfg.eval.video_episodes, 1))]
    if state is None and not cfg.policy.vla.model_path:  # nothing trained to film: the random baseline
        print("note: no checkpoint or policy.vla.model_path given: filming uniform random actions", file=sys.stderr)
        cfg.policy = dataclasses.replace(cfg.policy, name="random", chunk_size=1)
    check_claimable(cfg.runner.run_dir, "this record")
    rows, videos, _ = run_protocol(filming(cfg, len(seeds)), state["actor"] if state else None, seeds,
                                   record=set(range(len(seeds))))
    results = out_dir(cfg, path, "records", path.stem if path else "untrained")  # made only now: see eval
    with written_whole(results) as staging:
        names = [video.name for video in write_videos(staging, videos, rows, cfg.env)]
    for name in names:
        print((results / name).resolve())
    print(results.resolve())
    return 0


def filming(cfg: TrainConfig, episodes: int) -> TrainConfig:
    """``cfg`` with just enough envs for ``episodes`` (a training config's 128 envs would all run)."""
    per_round = cfg.placement.env_workers * cfg.placement.pipeline_stages
    num_envs = per_round * math.ceil(episodes / per_round)
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, num_envs=num_envs))
