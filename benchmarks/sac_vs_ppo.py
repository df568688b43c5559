"""Sample efficiency: SAC against PPO from scratch on a ManiSkill state task, on the same seeds.

    .venv/bin/python benchmarks/sac_vs_ppo.py [--task pushcube] [--seeds 1] [--minutes 30]
        [--out runs/sac_vs_ppo] [--report-only] [-- extra overrides for both]

Each (algorithm, seed) is one ``embodied train`` of at most ``--minutes`` wall-clock minutes, one
after another so each has the whole machine: PPO as ``make train`` runs it (policy=mlp), SAC as
``algorithm=sac policy=mlp_sac``. Both validate on 100 held-out episodes (greedy) every 12,800 env
steps (PPO: every 4 iterations of 3,200; SAC: every 100 of 128), so the env steps at which a run
first reaches ``--target`` success_once are read at the same resolution; the final protocol
evaluation (100 episodes) follows. It prints a markdown table (env steps and minutes to the
target, final success_once, env-steps/s) and the ratio SAC / PPO of the env steps to the target,
per seed, and writes ``sample_efficiency.png`` (validation success against env steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_from_scratch import markdown
from vla_sft_rl import run

from embodied.run_logger import read_scalars

TASKS = {"pushcube": "env=maniskill_pushcube", "pickcube": "env=maniskill_pickcube"}
ALGORITHMS = {"ppo": ["algorithm=ppo", "policy=mlp", "runner.eval_every=4"],
              "sac": ["algorithm=sac", "policy=mlp_sac", "runner.eval_every=100"]}


def train(name: str, task: str, seed: int, out: Path, minutes: float, extra: list[str]) -> None:
    run(["train", *ALGORITHMS[name], TASKS[task], f"runner.seed={seed}", f"runner.run_dir={out}",
         f"runner.max_minutes={minutes}", "runner.validation_episodes=100", "runner.total_env_steps=1000000000",
         "runner.progress=false", *extra])


def first_reaching(run_dir: Path, target: float) -> tuple[int | None, float | None]:
    """``(env steps, training minutes)`` of the first validation at or above ``target`` (None, None if none)."""
    minutes = dict(read_scalars(run_dir, "time/total_minutes"))
    for step, value in read_scalars(run_dir, "eval/success_once"):
        if value >= target:
            return step, minutes.get(step)
    return None, None


def row(name: str, seed: int, run_dir: Path, target: float) -> dict:
    steps, minutes = first_reaching(run_dir, target)
    trained = read_scalars(run_dir, "time/total_minutes")
    summary_file = run_dir / "eval.json"
    final = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {"algorithm": name, "seed": seed, f"env steps to {target:g}": steps if steps is not None else "-",
            f"minutes to {target:g}": f"{minutes:.1f}" if minutes is not None else "-",
            "final success_once": f"{final['success_once']:.2f}" if "success_once" in final else "-",
            "trained env steps": trained[-1][0] if trained else 0,
            "trained min": f"{trained[-1][1]:.1f}" if trained else "-",
            "env-steps/s": f"{final['training']['env_steps_per_s']:.0f}" if "training" in final else "-"}


def plot(out: Path, runs: list[tuple[str, int, Path]], target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, seed, run_dir in runs:
        points = read_scalars(run_dir, "eval/success_once")
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=f"{name} seed {seed}")
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("env steps")
    ax.set_ylabel("validation success_once (100 episodes, greedy)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "sample_efficiency.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="pushcube")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=["sac", "ppo"])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=Path("runs/sac_vs_ppo"))
    parser.add_argument("--report-only", action="store_true", help="only read the run directories under --out")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    runs = [(name, seed, args.out / f"{args.task}-{name}-seed{seed}")
            for seed in args.seeds for name in args.algorithms]
    if not args.report_only:
        for name, seed, run_dir in runs:
            print(f"{run_dir.name}: training ...", file=sys.stderr, flush=True)
            train(name, args.task, seed, run_dir, args.minutes, extra)
    runs = [r for r in runs if (r[2] / "tb").exists()]
    if not runs:
        sys.exit(f"no run directories under {args.out}: run without --report-only first.")
    print(markdown([row(name, seed, run_dir, args.target) for name, seed, run_dir in runs]))
    for seed in args.seeds:
        steps = {name: first_reaching(run_dir, args.target)[0] for name, s, run_dir in runs if s == seed}
        if steps.get("sac") and steps.get("ppo"):
            print(f"seed {seed}: SAC / PPO env steps to {args.target:g}: {steps['sac'] / steps['ppo']:.2f}")
    print(f"curves: {plot(args.out, runs, args.target)}")


if __name__ == "__main__":
    main()
