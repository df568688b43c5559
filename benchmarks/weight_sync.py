"""Weight sync actor -> rollout worker: time per method for one model size, on real Ray workers.

    .venv/bin/python benchmarks/weight_sync.py [--hidden 2048] [--repeats 5] [--json]

Each method syncs the same MLP (hidden sizes ``[H, H, H]``) from the actor (device 0)
to a rollout worker (device 1); the table gives the median wall time of a full sync
(``Workers.prepare_generation(force_sync=True)``) and the bandwidth it implies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from embodied.config import compose
from embodied.runner import start_workers

METHODS = ("shared_memory", "object_store", "broadcast")


def measure(method: str, hidden: int, repeats: int) -> dict:
    cfg = compose([
        "env.num_envs=2", "placement.env_workers=1", f"policy.net.hidden_sizes=[{hidden},{hidden},{hidden}]",
        "placement.mode=hybrid", "placement.env=0", "placement.rollout=1", "placement.actor=0",
        f"placement.weight_sync={method}",
    ])
    workers = start_workers(cfg)
    try:
        weights = workers.actor.call("get_weights")[0]
        megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
        workers.prepare_generation(force_sync=True)  # warm-up: first-use costs
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            workers.prepare_generation(force_sync=True)
            times.append(time.perf_counter() - t0)
    finally:
        workers.shutdown()
    median = statistics.median(times)
    return {"method": method, "megabytes": megabytes, "sync_ms": median * 1e3, "gb_per_s": megabytes / 1e3 / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(m, args.hidden, args.repeats) for m in METHODS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| method | weights (MB) | sync (ms) | GB/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['megabytes']:.1f} | {r['sync_ms']:.1f} | {r['gb_per_s']:.2f} |")


if __name__ == "__main__":
    main()
