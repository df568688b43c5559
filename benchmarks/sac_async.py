"""SAC's env-steps/s with asynchronous collection against lockstep collection, in one run.

    .venv/bin/python benchmarks/sac_async.py [--iterations 60] [--rounds 2] [--json] [-- overrides]

Each round runs ``embodied train algorithm=sac policy=mlp_sac`` twice on PushCube-v1 state, the same
seed and workload (the SAC config's 32 envs x 4 steps per iteration, 64 gradient steps each,
updates from the first iteration: ``algorithm.sac.learning_starts=0``), once per
``runner.collection`` (``sync``, ``async``), for ``--iterations`` iterations. It prints, per mode,
the median env-steps/s over the iterations after the first five (start-up costs), the median
update and rollout seconds per iteration, the mean policy lag, and the ratio async / sync of the
env-steps/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from vla_sft_rl import run

from embodied.run_logger import read_scalars

MODES = ("sync", "async")
WARMUP = 5  # iterations left out of the medians


def measure(mode: str, iterations: int, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        run(["train", "algorithm=sac", "policy=mlp_sac", f"runner.collection={mode}", f"runner.run_dir={out}",
             "algorithm.sac.learning_starts=0", f"runner.total_env_steps={iterations * 128}", "runner.eval_every=0",
             "runner.checkpoint_every=100000", "eval.episodes=8", "eval.video_episodes=0", "runner.progress=false",
             "runner.max_minutes=null", *extra])

        def median(tag: str) -> float:
            return statistics.median(v for _, v in read_scalars(Path(out), tag)[WARMUP:])

        lags = [v for _, v in read_scalars(Path(out), "train/policy_lag")]
        return {"env-steps/s": median("time/env_steps_per_s"), "update s": median("time/update_s"),
                "rollout s": median("time/rollout_s"), "policy lag": sum(lags) / len(lags)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):  # alternate who runs first
            print(f"round {round_ + 1}: {mode} ...", file=sys.stderr, flush=True)
            results[mode].append(measure(mode, args.iterations, extra))
    rows = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}
    ratio = rows["async"]["env-steps/s"] / rows["sync"]["env-steps/s"]
    if args.json:
        print(json.dumps({"modes": rows, "async_over_sync": ratio, "runs": results}, indent=2))
        return
    keys = list(rows["sync"])
    print("| runner.collection | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for mode, row in rows.items():
        print(f"| {mode} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
    print(f"async / sync env-steps/s: {ratio:.2f} (medians of {args.rounds} run(s) each)")


if __name__ == "__main__":
    main()
