"""How far RL moved a token VLA from its SFT checkpoint, measured on the SFT demos' states.

    .venv/bin/python benchmarks/vla_policy_drift.py --sft runs/vla_sft_rl/sft \\
        --demos runs/vla_sft_rl/demos/<file>.pt [--states 256] CHECKPOINT [CHECKPOINT ...]

For the SFT weights, each checkpoint and a control (the SFT weights moved by random noise as
long, tensor by tensor, as the first checkpoint's move) it prints: the parameter distance
from SFT, KL(SFT || policy) per action token, how often the greedy token is still SFT's, the
entropy per token, and each action dimension's mean expected bin. A checkpoint far in KL
but not in parameters changed behaviour on purpose; the control shows what a move of that
length does by chance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from embodied.checkpoint import load_checkpoint
from embodied.commands.common import config_from_saved
from envs.demos import Demos
from policies.registry import make_policy


def build(cfg, demos: Demos, weights: dict):
    """The policy of ``cfg`` with ``weights``, in eval mode."""
    spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in demos.obs.items()}
    policy = make_policy(cfg.policy, spec, demos.actions.shape[1])
    policy.load_state_dict(weights)
    return policy.eval()


@torch.no_grad()
def bin_logprobs(policy, obs: dict[str, torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
    """``[N, T, n_bins]``: every action token's distribution over the bins; autoregressive
    policies are fed ``prefix [N, T]`` (SFT's greedy bins, the same for every policy compared)."""
    return policy.bin_distributions(obs, prefix)[0]


def random_move_like(base: dict, moved: dict, generator: torch.Generator) -> dict:
    """``base`` plus Gaussian noise as long as ``moved - base``, tensor by tensor (buffers kept)."""
    out = {}
    for key, value in base.items():
        if not value.is_floating_point() or key == "action_stats":
            out[key] = value
            continue
        step = moved[key].float() - value.float()
        noise = torch.randn(value.shape, generator=generator)
        out[key] = value + noise * (step.norm() / (noise.norm() + 1e-12))
    return out


def distance(a: dict, b: dict) -> float:
    return sum(float(((a[k].float() - b[k].float()) ** 2).sum()) for k in a if a[k].is_floating_point()) ** 0.5


def report(name: str, policy, weights: dict, sft_weights: dict, sft_logp: torch.Tensor, obs: dict,
           prefix: torch.Tensor, action_dim: int) -> str:
    logp = bin_logprobs(policy, obs, prefix)
    kl = float((sft_logp.exp() * (sft_logp - logp)).sum(-1).mean())
    agree = float((logp.argmax(-1) == sft_logp.argmax(-1)).float().mean())
    entropy = float(-(logp.exp() * logp).sum(-1).mean())
    bins = torch.arange(logp.shape[-1], dtype=logp.dtype)
    mean_bin = (logp.exp() * bins).sum(-1).view(logp.shape[0], -1, action_dim).mean(dim=(0, 1))
    return (f"| {name} | {distance(weights, sft_weights):.3f} | {kl:.4f} | {agree:.3f} | {entropy:.3f} | "
            f"{' '.join(f'{b:.0f}' for b in mean_bin.tolist())} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", required=True, help="the SFT run directory or checkpoint")
    parser.add_argument("--demos", required=True, type=Path, help="the demos file SFT trained on")
    parser.add_argument("--states", type=int, default=256, help="demo states to measure on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("checkpoints", nargs="+", help="RL checkpoints (files or run directories)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    sft = load_checkpoint(args.sft)
    cfg = config_from_saved(sft["config_yaml"], [])
    demos = Demos.load(args.demos)
    picked = torch.randperm(len(demos), generator=generator)[:args.states]
    obs = {k: v[picked] for k, v in demos.obs.items()}
    sft_weights, action_dim = sft["actor"]["policy"], demos.actions.shape[1]
    sft_policy = build(cfg, demos, sft_weights)
    with torch.no_grad():
        prefix = sft_policy.act(obs, deterministic=True)[0]
    sft_logp = bin_logprobs(sft_policy, obs, prefix)
    print(f"{len(picked)} demo states of {args.demos.name}\n\n"
          "| weights | distance from SFT | KL(SFT, policy) per token | greedy token = SFT's | entropy per token | "
          "mean expected bin per action dim |\n|---|---:|---:|---:|---:|---|")
    rows = [("SFT", sft_weights)] + [(c, load_checkpoint(c)["actor"]["policy"]) for c in args.checkpoints]
    rows.append((f"SFT + random move as long as {args.checkpoints[0]}'s",
                 random_move_like(sft_weights, rows[1][1], generator)))
    for name, weights in rows:
        print(report(name, build(cfg, demos, weights), weights, sft_weights, sft_logp, obs, prefix, action_dim))


if __name__ == "__main__":
    main()
