"""Env-steps/s of one env process for each simulator family, from state and from a camera, in one run.

    .venv/bin/python benchmarks/env_throughput.py [--seconds 20] [--image-size 128] [--json]

Each row builds the real VecEnv (``make_vec_env``) with one env process: ManiSkill3 PushCube-v1 on
physx_cpu and MetaWorld reach-v3 with ``--envs`` envs in it (they share a process), LIBERO libero_spatial with
its one env (LIBERO never shares one). It resets, takes 10 warm-up steps, then steps uniformly random actions
for ``--seconds`` (at least 20 batch steps) and reports env-steps/s. ``rgb`` is each family's camera
observation at ``--image-size`` (LIBERO: agentview and wrist cameras; MetaWorld: corner2 and the 4-D state),
with its ``fast`` rendering; ``state`` renders nothing. The numbers of one run share the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from embodied.config import compose
from envs.registry import make_vec_env

WARMUP_STEPS = 10
MIN_STEPS = 20
# family -> (env option, its overrides, envs in the one process)
FAMILIES = {
    "ManiSkill3 PushCube-v1 (physx_cpu)": ("maniskill_pushcube", ["env.sim_backend=physx_cpu"], None),
    "LIBERO libero_spatial": ("libero_spatial", [], 1),
    "MetaWorld reach-v3": ("metaworld_mt1", [], None),
}


def measure(env_option: str, overrides: list[str], obs_mode: str, envs: int, seconds: float,
            image_size: int) -> dict:
    cfg = compose([f"env={env_option}", f"env.obs_mode={obs_mode}", f"env.image_size={image_size}",
                   f"env.num_envs={envs}", "env.num_procs=1", *overrides]).env
    env = make_vec_env(cfg)
    try:
        env.reset(seed=0)
        generator = torch.Generator().manual_seed(0)

        def random_step() -> None:
            env.step(torch.rand(envs, env.action_dim, generator=generator) * 2 - 1)

        for _ in range(WARMUP_STEPS):
            random_step()
        steps, t0 = 0, time.perf_counter()
        while steps < MIN_STEPS or time.perf_counter() - t0 < seconds:
            random_step()
            steps += 1
        elapsed = time.perf_counter() - t0
    finally:
        env.close()
    return {"obs_mode": obs_mode, "envs": envs, "steps": steps, "seconds": elapsed,
            "env_steps_per_s": steps * envs / elapsed}


def markdown(rows: list[dict], image_size: int) -> str:
    lines = ["| simulator | envs in the process | state: env-steps/s | "
             f"rgb {image_size} px: env-steps/s | rgb / state |", "|---|---:|---:|---:|---:|"]
    for family in dict.fromkeys(r["family"] for r in rows):
        by_mode = {r["obs_mode"]: r for r in rows if r["family"] == family}
        state, rgb = by_mode["state"]["env_steps_per_s"], by_mode["rgb"]["env_steps_per_s"]
        lines.append(f"| {family} | {by_mode['state']['envs']} | {state:.1f} | {rgb:.1f} | {rgb / state:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="timed stepping per row")
    parser.add_argument("--envs", type=int, default=4, help="envs in the process (ManiSkill, MetaWorld)")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for family, (option, overrides, envs) in FAMILIES.items():
        for mode in ("state", "rgb"):
            row = measure(option, overrides, mode, envs or args.envs, args.seconds, args.image_size)
            rows.append({"family": family, **row})
    print(json.dumps(rows, indent=2) if args.json else markdown(rows, args.image_size))


if __name__ == "__main__":
    main()
