"""Inference latency of the tiny VLAs per batch: ``act`` (sampling) on this machine's CPU or a GPU.

    .venv/bin/python benchmarks/vla_latency.py [--batches 1 8 32] [--repeats 10] [--threads 1]
                                               [--device cpu] [--json]

For each tiny policy config it builds the model, warms up, then times ``--repeats`` calls of
``act`` on 64 px images and reports the median per batch, and per simulator step (a chunked
policy decides ``chunk_size`` steps at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from embodied.config import compose
from policies.registry import make_policy

MODELS = ["openvla_tiny", "openvla_oft_tiny", "qwen_vl_tiny"]
SPEC = {"rgb": ((64, 64, 3), torch.uint8), "state": ((25,), torch.float32)}
ACTION_DIM = 8  # PushCube's pd_joint_delta_pos


def measure(model: str, batch: int, repeats: int, device: str) -> dict:
    cfg = compose([f"policy={model}", "policy.vla.instruction=push the cube to the goal region"]).policy
    torch.manual_seed(0)
    policy = make_policy(cfg, SPEC, ACTION_DIM).to(device).eval()
    obs = {"rgb": torch.randint(0, 256, (batch, 64, 64, 3), dtype=torch.uint8, device=device),
           "state": torch.randn(batch, 25, device=device)}
    times = []
    for i in range(repeats + 2):  # two warm-up calls
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        policy.act(obs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - started)
    median_ms = 1000 * statistics.median(times)
    return {"model": model, "params_m": sum(p.numel() for p in policy.parameters()) / 1e6, "batch": batch,
            "chunk": cfg.chunk_size, "tokens": policy.noise_dim, "act_ms": median_ms,
            "ms_per_env_step": median_ms / cfg.chunk_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(m, b, args.repeats, args.device) for m in MODELS for b in args.batches]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"device {args.device}, {args.threads} thread(s), median of {args.repeats}\n")
    print("| model | params (M) | chunk | tokens | batch | act (ms) | per env step (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params_m']:.2f} | {r['chunk']} | {r['tokens']} | {r['batch']} | "
              f"{r['act_ms']:.1f} | {r['ms_per_env_step']:.1f} |")


if __name__ == "__main__":
    main()
