"""``embodied sft policy=openvla_tiny env=... [overrides]``: warm-start a VLA on motion-planner demos
(supervised, on token actions), then evaluate it with the env's protocol.

It writes the same checkpoint format as ``embodied train``, so ``embodied train checkpoint=<sft run>``
continues from it with RL.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from embodied.commands.common import (
    composed_overrides,
    config_command,
    printed_job_config,
    removed_if_failed_empty,
    run_protocol,
)
from embodied.config import compose
from embodied.provenance import provenance
from envs.registry import check_env_config, env_action_dim, seed_scheme


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``sft``: the config flags and overrides."""
    config_command(subparsers, "sft", "warm-start a VLA on motion-planner demos, then evaluate it", __doc__, run,
                   "sft.* sets the demos and epochs")


def run(args: argparse.Namespace) -> int:
    """``sft``, or with ``--cfg job`` the config it would run."""
    overrides = composed_overrides(args)
    if printed_job_config(args, lambda: compose(overrides)):
        return 0
    return sft(overrides)


def sft(overrides: list[str]) -> int:
    """Train on the demos into a new run directory, evaluate the result, index the evaluation."""
    from embodied.checkpoint import load_checkpoint, resolve_checkpoint
    from embodied.evaluate import summarize, write_eval
    from embodied.run_dirs import claim_dir, index_evaluation, protocol_digest
    from embodied.sft import train_sft
    from policies.registry import check_policy_config

    cfg = compose(overrides)
    check_env_config(cfg.env)
    check_policy_config(cfg.policy, env_action_dim(cfg.env))
    run_dir = claim_dir(cfg.runner.run_dir, Path("runs"), f"sft-{cfg.env.task}-{cfg.policy.name}", "this SFT run")
    cfg.runner.run_dir = str(run_dir)
    with removed_if_failed_empty(run_dir):
        stats = train_sft(cfg, run_dir)
    seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    rows, _, _ = run_protocol(cfg, load_checkpoint(run_dir)["actor"], seeds)
    summary = summarize(rows, cfg.env, cfg.eval.tasks)
    summary["sft"] = stats
    evaluated = resolve_checkpoint(run_dir)
    summary.update(checkpoint=str(evaluated), policy=cfg.policy.name, provenance=provenance(cfg, evaluated))
    print(write_eval(run_dir, summary))
    index_evaluation(run_dir, run_dir, summary, "sft", str(evaluated), protocol_digest(cfg.eval, cfg.env, seeds))
    learned = ", ".join(f"{k.removeprefix('sft/').replace('_', ' ')} {v:.3f}" for k, v in stats.items()
                        if k.startswith("sft/"))
    print(f"SFT on {stats['demos']} demos ({stats['steps']} steps), {cfg.sft.epochs} epochs: {learned}; "
          f"eval success_once {summary['success_once']:.3f}")
    print(run_dir.resolve())
    return 0
