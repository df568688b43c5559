"""Does ``placement: auto`` pick the fastest plan, and does it predict its iteration time?

    .venv/bin/python benchmarks/plan_accuracy.py [--iterations 4] [--only NAME ...] [--json]
    .venv/bin/python benchmarks/plan_accuracy.py --from-json bench/plan_accuracy-<time>.json  # print again

For each workload of a grid (policy cost against simulator cost, env counts, pipeline depth
among the candidates), on this machine's devices:

1. profile the stages (``scheduler/profiler.py``; the profile is cached like auto's) and
   plan (``scheduler/planner.py``): the auto plan and its predicted iteration time;
2. run every feasible candidate plan with the real worker groups (pinned CPU slots on a CPU
   machine): one warm-up iteration, then ``--iterations`` measured ones of weight sync,
   rollout and update (PPO's epochs, or SAC's gradient steps; the ``-async`` workloads roll out
   during the update, ``runner.collection=async``);
3. report the best measured plan, the auto plan, auto's throughput over the best's, and
   auto's predicted against measured iteration time.

``--json`` prints ``{"workloads": [{name, best_plan, auto_plan, auto_over_best, predicted_s,
measured_s}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

COMMON = ["runner.progress=false", "placement.pin_cpus=true", "placement.profile_dir=runs/profiles",
          "algorithm.update_epochs=2", "algorithm.num_minibatches=2"]
WORKLOADS = {
    "state-mlp-8": ["env.num_envs=8", "algorithm.rollout_steps=25"],
    "state-mlp-32": ["env.num_envs=32", "algorithm.rollout_steps=25"],
    "state-wide-mlp-16": ["env.num_envs=16", "algorithm.rollout_steps=25", "policy.net.hidden_sizes=[1024,1024,1024]"],
    "rgb-cnn-8": ["env=maniskill_pushcube_rgb", "env.image_size=64", "env.num_envs=8", "policy=cnn",
                  "algorithm.rollout_steps=20"],
    "rgb-cnn-wide-8": ["env=maniskill_pushcube_rgb", "env.image_size=128", "env.num_envs=8", "policy=cnn_wide",
                       "algorithm.rollout_steps=20"],
    "rgb-oft-tiny-8": ["env=maniskill_pushcube_rgb", "env.image_size=64", "env.num_envs=8",
                       "env.max_episode_steps=100", "policy=openvla_oft_tiny", "algorithm.rollout_steps=5"],
    # SAC's update is its gradient steps (sac.utd per transition), not epochs over the batch
    "sac-state-32": ["algorithm=sac", "policy=mlp_sac", "env.num_envs=32", "algorithm.sac.learning_starts=0"],
    "sac-state-32-async": ["algorithm=sac", "policy=mlp_sac", "env.num_envs=32", "algorithm.sac.learning_starts=0",
                           "runner.collection=async"],
}


def measure_plan(cfg, iterations: int) -> float:
    """Median seconds of an iteration (weight sync, rollout, update; the rollout during the update of the
    one before under ``runner.collection=async``) after one warm-up."""
    from embodied.collection import make_collector
    from embodied.runner import start_workers

    workers = start_workers(cfg)
    try:
        workers.reset_envs(iteration=0, sim_steps=0)
        collector = make_collector(workers, cfg.runner.collection, cfg.runner.weight_sync_every)
        times = []
        for i in range(iterations + 1):
            started = time.perf_counter()
            workers.update(collector.collect(i).trajectories, i)
            times.append(time.perf_counter() - started)
        collector.settle()
        return statistics.median(times[1:])
    finally:
        workers.shutdown()


def run_workload(name: str, overrides: list[str], iterations: int) -> dict:
    import dataclasses

    from embodied.config import compose
    from embodied.runner import STAGE_RUNNERS
    from scheduler.auto import auto_placement
    from scheduler.placement import to_placement
    from scheduler.runtime.cluster import cluster_devices, start_cluster

    cfg = compose([*COMMON, *overrides])
    start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
    devices = cluster_devices()
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    auto = auto_placement(cfg, len(devices.devices), devices.kind, STAGE_RUNNERS, log=log)
    measured = {}
    for pred in auto.choice.table:
        if not pred.feasible:
            continue
        run_cfg = dataclasses.replace(cfg, placement=to_placement(pred.candidate, cfg.placement))
        measured[pred.candidate.name()] = (measure_plan(run_cfg, iterations), pred.iteration_s)
        print(f"{name}: {pred.candidate.name()}: measured {measured[pred.candidate.name()][0]:.3f} s, "
              f"predicted {pred.iteration_s:.3f} s", file=sys.stderr)
    best = min(measured, key=lambda k: measured[k][0])
    auto_name = auto.choice.best.candidate.name()
    auto_s, predicted = measured[auto_name]
    return {"name": name, "best_plan": best, "auto_plan": auto_name, "auto_over_best": measured[best][0] / auto_s,
            "predicted_s": predicted, "measured_s": auto_s, "predicted_over_measured": predicted / auto_s,
            "profile_seconds": auto.profile_seconds,
            "plans": {k: {"measured_s": m, "predicted_s": p} for k, (m, p) in measured.items()}}


def actor_ranks(plan_name: str) -> int:
    """The data-parallel actor ranks of a plan, from its name (``Candidate.name``: `` ranks=R``)."""
    found = re.search(r" ranks=(\d+)", plan_name)
    return int(found.group(1)) if found else 1


def ranks_markdown(rows: list[dict]) -> list[str]:
    """The grid with the actor ranks N as a dimension: each workload's best measured plan at each N."""
    out = ["\nBy actor ranks (N): the best measured plan of each workload at each N.\n",
           "| workload | N | best plan at N | measured (s) | predicted (s) | error | vs best of all N |",
           "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        best_s = min(m["measured_s"] for m in r["plans"].values())
        for n in sorted({actor_ranks(name) for name in r["plans"]}):
            at_n = {k: m for k, m in r["plans"].items() if actor_ranks(k) == n}
            name = min(at_n, key=lambda k: at_n[k]["measured_s"])
            m = at_n[name]
            out.append(f"| {r['name']} | {n} | {name} | {m['measured_s']:.3f} | {m['predicted_s']:.3f} | "
                       f"{100 * (m['predicted_s'] / m['measured_s'] - 1):+.0f}% | "
                       f"{best_s / m['measured_s']:.2f} |")
    return out


def grid_markdown(rows: list[dict]) -> str:
    """The grid (one row per workload), the verdict, the grid by actor ranks, then every measured
    plan of each workload."""
    out = ["| workload | best measured plan | auto plan | auto / best throughput | predicted (s) | measured (s) | "
           "error | profiling (s) | of a 20-min run |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['best_plan']} | {r['auto_plan']} | {r['auto_over_best']:.2f} | "
                   f"{r['predicted_s']:.2f} | {r['measured_s']:.2f} | "
                   f"{100 * (r['predicted_over_measured'] - 1):+.0f}% | "
                   f"{r['profile_seconds']:.0f} | {100 * r['profile_seconds'] / 1200:.1f}% |")
    good = sum(r["auto_over_best"] >= 0.95 for r in rows)
    close = sum(abs(r["predicted_over_measured"] - 1) <= 0.15 for r in rows)
    out.append(f"\nauto >= 0.95x best in {good}/{len(rows)}; predicted within 15% in {close}/{len(rows)}")
    if any(actor_ranks(name) > 1 for r in rows for name in r["plans"]):
        out += ranks_markdown(rows)
    for r in rows:
        out += [f"\n{r['name']} (`{' '.join(WORKLOADS[r['name']])}`):\n",
                "| plan | measured (s) | predicted (s) | error |", "|---|---:|---:|---:|"]
        for name, m in sorted(r["plans"].items(), key=lambda kv: kv[1]["measured_s"]):
            out.append(f"| {name}{' (auto)' if name == r['auto_plan'] else ''} | {m['measured_s']:.3f} | "
                       f"{m['predicted_s']:.3f} | {100 * (m['predicted_s'] / m['measured_s'] - 1):+.0f}% |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--from-json", help="print the grid of a saved run (bench/plan_accuracy-*.json)")
    args = parser.parse_args()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = [run_workload(n, WORKLOADS[n], args.iterations) for n in args.only or list(WORKLOADS)]
        Path("bench").mkdir(exist_ok=True)
        saved = Path("bench") / f"plan_accuracy-{time.strftime('%Y%m%d-%H%M%S')}.json"
        saved.write_text(json.dumps(rows, indent=2))
    if args.json:
        print(json.dumps({"workloads": [{k: r[k] for k in ("name", "best_plan", "auto_plan", "auto_over_best",
                                                           "predicted_s", "measured_s")} for r in rows]}, indent=2))
        return
    print(grid_markdown(rows))


if __name__ == "__main__":
    main()
