"""SFT warm start, then RL, of a tiny VLA on ManiSkill from RGB, in one wall-clock budget.

    .venv/bin/python benchmarks/vla_sft_rl.py [--policy openvla_oft_tiny] [--demos 100]
        [--sft-epochs 12] [--rl-minutes 50] [--eval-episodes 100] [--out runs/vla_sft_rl]
        [--json] [-- extra train overrides, e.g. algorithm.lr=1e-4]

Three commands a user would type, run in order (``embodied sft``, ``embodied train
checkpoint=<sft run>``), each evaluated by the standard protocol on the same fixed seeds
(``eval.seed`` + k, ``--eval-episodes`` episodes, greedy):

1. ``embodied sft``: record ``--demos`` motion-planner demos (into ``--out``, not the cache), ``--sft-epochs`` of
   cross-entropy on the action tokens, evaluate: the *before* row;
2. ``embodied train checkpoint=<sft run>``: PPO (or GRPO, with the override ``algorithm=grpo``)
   from the SFT weights for ``--rl-minutes`` of training, evaluate: the *after* row, plus a video.

It prints the before / after table, writes ``learning_curve.png`` (training episodes' success
per iteration, with both evaluations marked) and reports the wall time of the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ENV = ["env=maniskill_pushcube_rgb", "env.image_size=64", "env.max_episode_steps=100"]
# PPO for a warm-started policy: a smaller step, returns over a 25-decision episode (chunks of 4)
RL = ["algorithm.lr=1e-4", "algorithm.gamma=0.9", "algorithm.gae_lambda=0.95", "algorithm.rollout_steps=25",
      "algorithm.update_epochs=4", "algorithm.num_minibatches=8", "runner.total_env_steps=100000000",
      "runner.eval_every=0", "eval.video_episodes=1", "runner.progress=false"]


def run(args: list[str]) -> float:
    """Run ``embodied <args>``; returns its wall time. A failure stops the benchmark with its output."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "embodied.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"`embodied {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def rl_algorithm(rl_dir: Path) -> str:
    """What the RL phase ran, as its saved config says (PPO, or GRPO with ``algorithm=grpo``)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.load(rl_dir / "config.yaml").algorithm.name).upper()


def plot(rl_dir: Path, before: float, after: float, out: Path, algorithm: str) -> Path:
    """Training episodes' success and return per iteration (sampled actions), with the greedy
    evaluations of the SFT checkpoint (step 0) and of the final policy marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    success = scalars(rl_dir, "env/success_once")
    last = success[-1][0] if success else 1
    if success:
        top.plot(*zip(*success, strict=True), alpha=0.4, label="training episodes (sampled actions)")
        top.plot(*zip(*_smooth(success), strict=True), label="same, mean of 5 iterations")
    top.scatter([0, last], [before, after], color="red", zorder=3, label="eval, 100 episodes, greedy")
    top.set_ylabel("success rate")
    top.set_ylim(0, 1)
    top.legend(fontsize=8)
    returns = scalars(rl_dir, "env/return")
    if returns:
        bottom.plot(*zip(*returns, strict=True), alpha=0.4)
        bottom.plot(*zip(*_smooth(returns), strict=True))
    bottom.set_ylabel("training episode return (the env's reward_mode)")
    bottom.set_xlabel("RL env steps")
    top.set_title(f"PushCube-v1 from RGB: tiny OpenVLA-OFT, SFT then {algorithm}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def _smooth(points: list[tuple[int, float]], window: int = 5) -> list[tuple[int, float]]:
    return [(points[i][0], sum(v for _, v in points[max(0, i - window + 1):i + 1]) / len(points[max(0, i - window + 1):i + 1]))
            for i in range(len(points))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="openvla_oft_tiny")
    parser.add_argument("--demos", type=int, default=100)
    parser.add_argument("--sft-epochs", type=int, default=12)
    parser.add_argument("--rl-minutes", type=float, default=50)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--out", default="runs/vla_sft_rl")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reuse-sft", action="store_true",
                        help="keep <out>/sft (and the wall time it recorded in <out>/sft_wall_s) and rerun only RL")
    parser.add_argument("overrides", nargs="*", help="extra `embodied train` overrides")
    args = parser.parse_args()
    out = Path(args.out)
    sft_dir, rl_dir = out / "sft", out / "rl"
    common = [*ENV, f"policy={args.policy}", f"eval.episodes={args.eval_episodes}"]
    started = time.perf_counter()
    if args.reuse_sft:
        sft_s = float((out / "sft_wall_s").read_text())
    else:
        # demos are recorded afresh into the output directory: their time counts
        sft_s = run(["sft", *common, f"sft.demos={args.demos}", f"sft.epochs={args.sft_epochs}",
                     f"sft.demos_dir={out / 'demos'}", "runner.progress=false", f"runner.run_dir={sft_dir}"])
        (out / "sft_wall_s").write_text(f"{sft_s:.1f}")
    if rl_dir.exists():
        rl_dir.rename(out / f"rl-before-{time.strftime('%H%M%S')}")  # an earlier attempt stays readable
    rl_s = run(["train", f"checkpoint={sft_dir}", *RL, f"eval.episodes={args.eval_episodes}",
                f"runner.max_minutes={args.rl_minutes}", f"runner.run_dir={rl_dir}", *args.overrides])
    total_s = time.perf_counter() - started + (sft_s if args.reuse_sft else 0.0)
    before, after = (json.loads((d / "eval.json").read_text()) for d in (sft_dir, rl_dir))
    algorithm = rl_algorithm(rl_dir)
    png = plot(rl_dir, before["success_once"], after["success_once"], out / "learning_curve.png", algorithm)
    result = {
        "policy": args.policy, "rl_algorithm": algorithm, "eval_episodes": args.eval_episodes, "eval_seeds": before["seeds"][:1] + ["..."],
        "sft": {"success_once": before["success_once"], "return_mean": before["return_mean"], "wall_s": sft_s},
        "rl": {"success_once": after["success_once"], "return_mean": after["return_mean"], "wall_s": rl_s,
               "env_steps": after["training"]["env_steps"]},
        "gain_points": 100 * (after["success_once"] - before["success_once"]),
        "total_minutes": total_s / 60, "learning_curve": str(png), "videos": str(rl_dir / "videos"),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"| checkpoint | eval episodes | success_once | return_mean | wall (min) |\n|---|---:|---:|---:|---:|\n"
          f"| SFT ({args.demos} demos, {args.sft_epochs} epochs) | {args.eval_episodes} | "
          f"{before['success_once']:.3f} | {before['return_mean']:.2f} | {sft_s / 60:.1f} |\n"
          f"| + {algorithm} ({result['rl']['env_steps']} env steps) | {args.eval_episodes} | {after['success_once']:.3f} | "
          f"{after['return_mean']:.2f} | {rl_s / 60:.1f} |")
    print(f"gain: {result['gain_points']:+.1f} points; whole pipeline {result['total_minutes']:.1f} min; "
          f"curve {png}; video in {rl_dir / 'videos'}")


if __name__ == "__main__":
    main()
