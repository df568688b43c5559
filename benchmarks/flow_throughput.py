"""What a flow-matching policy costs per env step against the token-action policy, in one run.

    .venv/bin/python benchmarks/flow_throughput.py [--envs 128] [--rollout-steps 25] [--rounds 5]
        [--train-iterations 4] [--json]

Two measurements, every policy in the same process, interleaved round by round:

- **policy**: one PPO iteration's policy work on the default run's shapes (``--rollout-steps`` calls
  of ``act`` on ``--envs`` states, then 8 epochs x 16 minibatches of ``evaluate`` + backward + Adam),
  divided by its env steps: milliseconds per 1000 env steps;
- **train** (``--train-iterations`` > 0): ``embodied train`` of that many iterations on PushCube per
  policy, the median env-steps/s after the first iteration (the simulator included, as a user sees it).

Policies: ``mlp_tokens`` (the reference), ``mlp_flow`` with Flow-SDE and with Flow-Noise (K = 4).
The ratio is each policy's cost over ``mlp_tokens``'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from embodied.config import compose
from embodied.run_logger import read_scalars
from policies.registry import make_policy

POLICIES = {"mlp_tokens": ["policy=mlp_tokens"], "mlp_flow (sde)": ["policy=mlp_flow"],
            "mlp_flow (noise)": ["policy=mlp_flow", "policy.flow.method=noise"]}
STATE_DIM, ACTION_DIM = 35, 8  # PushCube-v1 state and pd_joint_delta_pos actions
EPOCHS, MINIBATCHES = 8, 16


def policy_iteration_s(overrides: list[str], envs: int, rollout_steps: int) -> float:
    """Seconds of one iteration's policy work (rollout acts, then the update's passes)."""
    torch.manual_seed(0)
    policy = make_policy(compose(overrides).policy, {"state": ((STATE_DIM,), "float32")}, ACTION_DIM)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    obs = {"state": torch.randn(envs, STATE_DIM)}
    started = time.perf_counter()
    stored = [policy.act(obs)[0] for _ in range(rollout_steps)]
    actions = torch.cat(stored)
    states = obs["state"].repeat(rollout_steps, 1)
    size = len(actions) // MINIBATCHES
    for _ in range(EPOCHS):
        for mb in range(MINIBATCHES):
            rows = slice(mb * size, (mb + 1) * size)
            logprob, entropy, value = policy.evaluate({"state": states[rows]}, actions[rows])
            loss = -logprob.sum(-1).mean() - 0.01 * entropy.mean() + value.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return time.perf_counter() - started


def train_env_steps_per_s(overrides: list[str], iterations: int, envs: int, rollout_steps: int) -> float:
    from vla_sft_rl import run

    with tempfile.TemporaryDirectory() as out:
        run(["train", *overrides, f"runner.run_dir={out}", f"env.num_envs={envs}",
             f"algorithm.rollout_steps={rollout_steps}", f"runner.total_env_steps={iterations * envs * rollout_steps}",
             "runner.eval_every=0", "eval.episodes=8", "eval.video_episodes=0", "runner.progress=false"])
        rates = [v for _, v in read_scalars(Path(out), "time/env_steps_per_s")[1:]]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=128)
    parser.add_argument("--rollout-steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-iterations", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(args.rounds):
        for name, overrides in POLICIES.items():
            times[name].append(policy_iteration_s(overrides, args.envs, args.rollout_steps))
    env_steps = args.envs * args.rollout_steps
    rows = {name: {"policy ms / 1k env steps": 1000 * statistics.median(t) / env_steps * 1000}
            for name, t in times.items()}
    if args.train_iterations:
        for name, overrides in POLICIES.items():
            print(f"{name}: training {args.train_iterations} iterations ...", file=sys.stderr, flush=True)
            rows[name]["train env-steps/s"] = train_env_steps_per_s(overrides, args.train_iterations, args.envs,
                                                                     args.rollout_steps)
    base = rows["mlp_tokens"]
    for row in rows.values():
        row["policy cost / mlp_tokens"] = row["policy ms / 1k env steps"] / base["policy ms / 1k env steps"]
        if "train env-steps/s" in row:
            row["train time / mlp_tokens"] = base["train env-steps/s"] / row["train env-steps/s"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = list(next(iter(rows.values())))
    print("| policy | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
