"""LIBERO env throughput per process, with and without rendering, through the real VecEnv.

    .venv/bin/python benchmarks/libero_throughput.py [--suite libero_spatial] [--steps 100]
                                                     [--procs 1 2] [--json]

For each observation mode (``rgb``: agentview + wrist cameras at ``--image-size``;
``state``: no cameras, no offscreen rendering) and process count, it builds
``make_vec_env`` with one env per process, resets every env to its task's init state,
takes 10 warm-up steps, then times ``--steps`` batched steps of uniformly random
actions. Reported: batch steps/s, env-steps/s in total and per process, and the
scaling over one process.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from embodied.config import compose
from envs.libero import episode_seed
from envs.registry import make_vec_env

WARMUP_STEPS = 10


def measure(suite: str, obs_mode: str, procs: int, steps: int, image_size: int) -> dict:
    cfg = compose([f"env={suite}", f"env.obs_mode={obs_mode}",
                   f"env.image_size={image_size}", f"env.num_envs={procs}", f"env.num_procs={procs}"]).env
    env = make_vec_env(cfg)
    try:
        env.reset(seed=[episode_seed(i % 10, i) for i in range(procs)])
        generator = torch.Generator().manual_seed(0)

        def random_step() -> None:
            env.step(torch.rand(procs, env.action_dim, generator=generator) * 2 - 1)

        for _ in range(WARMUP_STEPS):
            random_step()
        t0 = time.perf_counter()
        for _ in range(steps):
            random_step()
        elapsed = time.perf_counter() - t0
    finally:
        env.close()
    return {"obs_mode": obs_mode, "procs": procs, "steps": steps, "seconds": elapsed,
            "env_steps_per_s": steps * procs / elapsed, "per_process": steps / elapsed}


def markdown(rows: list[dict]) -> str:
    single = {r["obs_mode"]: r["env_steps_per_s"] for r in rows if r["procs"] == 1}
    lines = ["| observations | processes | env-steps/s | per process | vs 1 process |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        base = single.get(r["obs_mode"])
        scale = f"{r['env_steps_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['obs_mode']} | {r['procs']} | {r['env_steps_per_s']:.1f} | "
                     f"{r['per_process']:.1f} | {scale} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--steps", type=int, default=100, help="timed batch steps per configuration")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(args.suite, mode, procs, args.steps, args.image_size)
            for mode in ("rgb", "state") for procs in args.procs]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
