"""RL from scratch on ManiSkill state tasks: PPO vs GRPO x Gaussian, token-action and flow-matching
(Flow-SDE, Flow-Noise) policies x tasks.

    .venv/bin/python benchmarks/rl_from_scratch.py [--only ppo-tokens-pushcube ...] [--minutes 30]
        [--out runs/rl_from_scratch] [--report-only] [-- extra train overrides]

Each cell is one ``embodied train`` of ``--minutes`` wall-clock minutes (it stops earlier once two
validations in a row reach ``runner.stop_at_success``), run one after another so each has the
whole machine. Validations run every ``runner.eval_every`` iterations on 100 held-out episodes
(the validation seed stream: never trained on, never the final evaluation's), greedy.

It prints a markdown table (success_once of the last validation at or before 10, 20 and 30
minutes of training, the final evaluation's, env-steps/s) and writes ``learning_curves.png``
(validation success against training minutes, one line per cell). ``--report-only`` rebuilds
both from the run directories under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vla_sft_rl import run

from embodied.run_logger import read_scalars

TASKS = {"pushcube": "env=maniskill_pushcube", "pickcube": "env=maniskill_pickcube"}
POLICIES = {"gaussian": ["policy=mlp"], "tokens": ["policy=mlp_tokens"], "flow_sde": ["policy=mlp_flow"],
            "flow_noise": ["policy=mlp_flow", "policy.flow.method=noise"]}
ALGORITHMS = {"ppo": ["algorithm=ppo"], "grpo": ["algorithm=grpo"]}
CELLS = {f"{a}-{p}-{t}": [*ALGORITHMS[a], *POLICIES[p], TASKS[t]]
         for t in TASKS for a in ALGORITHMS for p in POLICIES}
MARKS = (10, 20, 30)  # minutes of training at which the table reads the validations


def train(name: str, out: Path, minutes: float, extra: list[str]) -> None:
    run(["train", *CELLS[name], f"runner.run_dir={out / name}", f"runner.max_minutes={minutes}",
         "runner.validation_episodes=100", "runner.total_env_steps=1000000000", "runner.progress=false", *extra])


def validations_by_minute(run_dir: Path) -> list[tuple[float, float]]:
    """``(training minutes, validation success_once)`` of each periodic validation: a validation is
    logged at the env step of the iteration it followed, whose ``time/total_minutes`` it takes."""
    minutes = dict(read_scalars(run_dir, "time/total_minutes"))
    return [(minutes[step], value) for step, value in read_scalars(run_dir, "eval/success_once") if step in minutes]


def at_minute(points: list[tuple[float, float]], mark: float, stopped_at: float) -> str:
    """The last validation at or before ``mark`` minutes; a run that stopped earlier keeps its last."""
    before = [value for minute, value in points if minute <= mark]
    if not before:
        return "-"
    return f"{before[-1]:.2f}" + ("" if stopped_at >= mark else " (stopped)")


def row(name: str, run_dir: Path) -> dict:
    points = validations_by_minute(run_dir)
    minutes = read_scalars(run_dir, "time/total_minutes")
    stopped_at = minutes[-1][1] if minutes else 0.0
    rates = [v for _, v in read_scalars(run_dir, "time/env_steps_per_s")[1:]]  # the first iteration warms up
    summary_file = run_dir / "eval.json"
    final = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {"cell": name, **{f"{m} min": at_minute(points, m, stopped_at) for m in MARKS},
            "final eval": f"{final['success_once']:.2f} ({final['episodes']})" if "success_once" in final else "-",
            "trained min": f"{stopped_at:.1f}", "env steps": minutes[-1][0] if minutes else 0,
            "env-steps/s": f"{statistics.median(rates):.0f}" if rates else "-"}


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot(out: Path, names: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4), sharey=True)
    for ax, task in zip(axes, TASKS, strict=True):
        for name in (n for n in names if n.endswith(task)):
            points = validations_by_minute(out / name)
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=name.removesuffix(f"-{task}"))
        ax.set_title(f"{task}: validation success_once (100 held-out episodes, greedy)", fontsize=9)
        ax.set_xlabel("training minutes (2-core CPU)")
        ax.set_ylim(0, 1.02)
        if ax.lines:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("success_once")
    fig.tight_layout()
    path = out / "learning_curves.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CELLS), help="these cells (default: all)")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("runs/rl_from_scratch"))
    parser.add_argument("--report-only", action="store_true", help="only read the run directories under --out")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    names = args.only or list(CELLS)
    if not args.report_only:
        for name in names:
            print(f"{name}: training ...", file=sys.stderr, flush=True)
            train(name, args.out, args.minutes, extra)
    done = [n for n in names if (args.out / n / "tb").exists()]
    if not done:
        sys.exit(f"no run directories under {args.out} for {names}: run without --report-only first.")
    print(markdown([row(n, args.out / n) for n in done]))
    print(f"curves: {plot(args.out, done)}")


if __name__ == "__main__":
    main()
