"""SFT warm start, then RL, of a tiny VLA on ManiSkill from RGB, in one wall-clock budget.

    .venv/bin/python benchmarks/vla_sft_rl.py [--policy openvla_oft_tiny] [--demos 100]
        [--sft-epochs 12] [--rl-minutes 50] [--eval-episodes 100] [--out runs/vla_sft_rl]
        [--select best --validate-every 10 --validation-episodes 64] [--reuse-sft] [--json]
        [-- extra train overrides, e.g. algorithm.lr=1e-4]

Commands a user would type, run in order, each evaluated by the standard protocol on the
same fixed seeds (``eval.seed`` + k, ``--eval-episodes`` episodes):

1. ``embodied sft``: record ``--demos`` motion-planner demos (into ``--out``, not the cache), ``--sft-epochs`` of
   cross-entropy on the action tokens, evaluate greedily: the *before* row;
2. ``embodied train checkpoint=<sft run>``: PPO (or GRPO, with the override ``algorithm=grpo``,
   which keeps GRPO's own update: 8 epochs x 16 minibatches)
   from the SFT weights for ``--rl-minutes`` of training, plus a video. With ``--select best``
   it validates every ``--validate-every`` iterations on other seeds and keeps the best weights
   (``runner.final_weights=best``), judged by the policy as RL samples it;
3. ``embodied eval``, on fresh workers, of both checkpoints: greedy, and sampled (temperature
   ``policy.temperature``, the policy RL trains). Sampled evaluations draw the same noise for
   the same seed in both (same ``env.num_envs`` and ``runner.seed``), so they are paired.

It prints the before / after table, writes ``learning_curve.png`` (training episodes' success
per iteration, the validations and the evaluations) and reports the wall time of the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from embodied.evaluate import paired_gain
from embodied.run_logger import read_scalars as scalars

ENV = ["env=maniskill_pushcube_rgb", "env.image_size=64", "env.max_episode_steps=100"]
# RL from a warm start: a smaller step, 25 decisions (chunks of 4) an iteration: one whole episode
RL = ["algorithm.lr=1e-4", "algorithm.rollout_steps=25", "runner.total_env_steps=100000000",
      "runner.eval_every=0", "eval.video_episodes=1", "runner.progress=false"]
# PPO only: returns over the 25-decision episode and a lighter update. Not applied under
# `algorithm=grpo`, whose group keeps its own update (Hydra applies these dotted overrides after
# any `algorithm=` group, so they would silently replace GRPO's 8 epochs x 16 minibatches)
PPO = ["algorithm.gamma=0.9", "algorithm.gae_lambda=0.95", "algorithm.update_epochs=4", "algorithm.num_minibatches=8"]


def rl_settings(overrides: list[str]) -> list[str]:
    """The benchmark's RL overrides for the algorithm ``overrides`` choose (PPO unless ``algorithm=...``)."""
    algorithm = next((o.split("=", 1)[1] for o in overrides if o.startswith("algorithm=")), "ppo")
    return RL + (PPO if algorithm == "ppo" else [])


def run(args: list[str]) -> float:
    """Run ``embodied <args>``; returns its wall time. A failure stops the benchmark with its output."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "embodied.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"`embodied {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def plot(rl_dir: Path, rows: dict[str, dict], rl_step: int, out: Path, algorithm: str) -> Path:
    """Training episodes' success and return per iteration (sampled actions), the periodic
    validations, and the evaluations of the SFT checkpoint (step 0) and of the RL weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    success = scalars(rl_dir, "env/success_once")
    if success:
        top.plot(*zip(*success, strict=True), alpha=0.3, label="training episodes (sampled actions)")
        top.plot(*zip(*_smooth(success), strict=True), label="same, mean of 5 iterations")
    validation = scalars(rl_dir, "eval/success_once")
    if validation:
        top.plot(*zip(*validation, strict=True), marker="o", label="validation (other seeds)")
    for protocol, color in (("greedy", "red"), ("sampled", "black")):
        top.scatter([0, rl_step], [rows["sft"][protocol], rows["rl"][protocol]], color=color, zorder=3,
                    label=f"eval, {protocol}")
    top.set_ylabel("success rate")
    top.set_ylim(0, 1)
    top.legend(fontsize=7)
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
    windows = [points[max(0, i - window + 1):i + 1] for i in range(len(points))]
    return [(points[i][0], sum(v for _, v in w) / len(w)) for i, w in enumerate(windows)]


def evaluate(checkpoint: Path, out_dir: Path, sampled: bool, num_envs: int, episodes: int) -> tuple[dict, float]:
    """``embodied eval`` of ``checkpoint`` on fresh workers: (its eval.json, wall seconds)."""
    wall = run(["eval", f"checkpoint={checkpoint}", f"eval.deterministic={str(not sampled).lower()}",
                f"env.num_envs={num_envs}", "runner.seed=1", f"eval.episodes={episodes}", "eval.videos_per_task=0",
                "runner.progress=false", f"runner.run_dir={out_dir}"])
    return json.loads((out_dir / "eval.json").read_text()), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="openvla_oft_tiny")
    parser.add_argument("--demos", type=int, default=100)
    parser.add_argument("--sft-epochs", type=int, default=12)
    parser.add_argument("--rl-minutes", type=float, default=50)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--select", choices=["last", "best"], default="last",
                        help="evaluate the last RL weights, or the best periodic validation's")
    parser.add_argument("--validate-every", type=int, default=10, help="--select best: iterations between validations")
    parser.add_argument("--validation-episodes", type=int, default=64, help="--select best: episodes per validation")
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
    for old in (rl_dir, out / "evals"):
        if old.exists():  # an earlier attempt stays readable
            old.rename(out / f"{old.name}-before-{time.strftime('%H%M%S')}")
    select = [] if args.select == "last" else [
        f"runner.eval_every={args.validate_every}", f"runner.validation_episodes={args.validation_episodes}",
        "runner.final_weights=best", "eval.deterministic=false"]
    rl_s = run(["train", f"checkpoint={sft_dir}", *rl_settings(args.overrides), *select,
                f"eval.episodes={args.eval_episodes}", f"runner.max_minutes={args.rl_minutes}",
                f"runner.run_dir={rl_dir}", *args.overrides])
    rl_eval = json.loads((rl_dir / "eval.json").read_text())
    rl_ckpt = rl_dir / "checkpoints" / "best.pt" if rl_eval["evaluated"]["weights"] == "best" else rl_dir
    num_envs = int(OmegaConf.load(rl_dir / "config.yaml").env.num_envs)
    before = json.loads((sft_dir / "eval.json").read_text())  # `embodied sft` evaluated it greedily
    summaries = {"sft": {"greedy": before}, "rl": {}}
    sft_protocols = ("sampled",) if before["episodes"] == args.eval_episodes else ("greedy", "sampled")
    eval_s = 0.0
    for name, ckpt, protocols in (("sft", sft_dir, sft_protocols), ("rl", rl_ckpt, ("greedy", "sampled"))):
        for protocol in protocols:
            summary, wall = evaluate(ckpt, out / "evals" / f"{name}_{protocol}", protocol == "sampled",
                                     num_envs, args.eval_episodes)
            summaries[name][protocol], eval_s = summary, eval_s + wall
    rows = {name: {p: s["success_once"] for p, s in by.items()} for name, by in summaries.items()}
    # per-seed paired: both checkpoints ran the same seeds, so the seeds' difficulty cancels
    gains = {p: paired_gain(summaries["sft"][p]["rows"], summaries["rl"][p]["rows"]) for p in ("greedy", "sampled")}
    total_s = time.perf_counter() - started + (sft_s if args.reuse_sft else 0.0)
    algorithm = str(OmegaConf.load(rl_dir / "config.yaml").algorithm.name).upper()
    training = rl_eval["training"]
    rl_step = training["env_steps"] * rl_eval["evaluated"]["iteration"] // max(training["iterations"], 1)
    png = plot(rl_dir, rows, rl_step, out / "learning_curve.png", algorithm)
    result = {
        "policy": args.policy, "rl_algorithm": algorithm, "eval_episodes": args.eval_episodes,
        "eval_seeds": before["seeds"][:1] + ["..."], "success_once": rows,
        "gain_points": {p: 100 * g["gain"] for p, g in gains.items()},
        "gain_points_ci95": {p: [100 * x for x in g["ci95"]] for p, g in gains.items()},
        "rl_weights": rl_eval["evaluated"], "rl_env_steps": rl_eval["training"]["env_steps"],
        "wall_minutes": {"sft": sft_s / 60, "rl": rl_s / 60, "evals": eval_s / 60, "total": total_s / 60},
        "learning_curve": str(png), "videos": str(rl_dir / "videos"),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    weights, sft_cfg = rl_eval["evaluated"], OmegaConf.load(sft_dir / "config.yaml").sft
    print(f"| checkpoint | greedy success_once | sampled success_once | wall (min) |\n|---|---:|---:|---:|\n"
          f"| SFT ({sft_cfg.demos} demos, {sft_cfg.epochs} epochs) | {rows['sft']['greedy']:.3f} | "
          f"{rows['sft']['sampled']:.3f} | {sft_s / 60:.1f} |\n"
          f"| + {algorithm}, {weights['weights']} weights (iteration {weights['iteration']} of "
          f"{rl_eval['training']['iterations']}, {result['rl_env_steps']} env steps) | {rows['rl']['greedy']:.3f} | "
          f"{rows['rl']['sampled']:.3f} | {rl_s / 60:.1f} |")
    for protocol, g in gains.items():
        lo, hi = (100 * x for x in g["ci95"])
        print(f"gain, {protocol}: {100 * g['gain']:+.1f} points (95% interval {lo:+.1f} to {hi:+.1f}, paired over "
              f"{g['episodes']} seeds: {g['improved']} newly solved, {g['worsened']} lost)")
    print(f"evaluations {eval_s / 60:.1f} min; whole pipeline {total_s / 60:.1f} min; curve {png}; "
          f"video in {rl_dir / 'videos'}")


if __name__ == "__main__":
    main()
