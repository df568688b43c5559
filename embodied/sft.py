"""Supervised warm start: a token policy (VLA) learns the motion planner's demonstrations.

Read top to bottom: record (or load the cached) demos, then ``sft.epochs`` epochs of
minibatches of cross-entropy over the demo actions' tokens (their bins under the policy's
action tokenizer), then a checkpoint in the format ``train`` (``checkpoint=`` warm start),
``eval`` and ``record`` read.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch

from embodied.checkpoint import Progress, checkpoint_state, save_checkpoint
from embodied.config import TrainConfig, to_yaml
from embodied.run_logger import RunLogger
from envs.common import UserError
from envs.demos import Demos, generate_demos
from envs.registry import env_action_dim
from envs.seeds import Purpose, RunSeeds
from policies.base import POLICIES
from policies.registry import check_policy_config, make_policy
from policies.vla.action_tokenizer import ActionStats


def demos_for(cfg: TrainConfig, progress: bool) -> Demos:
    """The run's demos from the cache, or recorded now and cached."""
    e, s = cfg.env, cfg.sft
    name = f"{e.task}-{e.obs_mode}{e.image_size}-{s.demos}demos-seed{s.demo_seed}.pt"
    path = Path(s.demos_dir) / name
    if path.exists():
        return Demos.load(path)
    demos = generate_demos(e, s.demos, s.demo_seed, progress=progress)
    demos.save(path)
    return demos


def chunk_targets(actions: torch.Tensor, episode: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """What a policy decoding ``chunk_size`` actions learns at each demo step: that step's action
    and the next ones of its demo, the last action repeated past the demo's end.

    ``actions [N, A]``, ``episode [N]`` (demos stored one after another) -> ``[N, chunk_size, A]``.
    """
    n = actions.shape[0]
    last_step = torch.zeros(n, dtype=torch.long)
    for e in episode.unique():
        rows = (episode == e).nonzero().flatten()
        last_step[rows] = rows.max()
    index = torch.minimum(torch.arange(n)[:, None] + torch.arange(chunk_size), last_step[:, None])
    return actions[index]


def sft_step(policy, optimizer, obs: dict, actions: torch.Tensor) -> dict[str, float]:
    """One gradient step of cross-entropy over the action tokens of ``actions [B, chunk_size, A]``."""
    bins = policy.actions.bins(actions).flatten(1)
    logp, _ = policy.bin_distributions(obs, bins.float())
    token_logp = logp.gather(-1, bins.unsqueeze(-1)).squeeze(-1)
    loss = -token_logp.mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return {"loss": loss.item(), "token_accuracy": (logp.argmax(-1) == bins).float().mean().item()}


def train_sft(cfg: TrainConfig, run_dir: Path) -> dict:
    """Warm-start ``cfg.policy`` on demos of ``cfg.env.task``; returns the last epoch's statistics."""
    check_policy_config(cfg.policy, env_action_dim(cfg.env))
    if not POLICIES.get(cfg.policy.name).token_actions:
        raise UserError(f"embodied sft trains token policies (VLAs): policy={cfg.policy.name} has no action "
                        "tokens. Use policy=openvla_tiny or policy=qwen_vl_tiny (or a real VLA config).")
    demos = demos_for(cfg, cfg.runner.progress)
    obs_spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in demos.obs.items()}
    seeds = RunSeeds(cfg.runner.seed)
    torch.manual_seed(seeds.generator(Purpose.INIT))
    policy = make_policy(cfg.policy, obs_spec, demos.actions.shape[-1])
    # OpenVLA's fine-tuning recipe: the new dataset's q01 / q99 map to the ends of the 256 bins, so
    # the bins resolve the range the demos use (joint deltas of a slow planner span a few % of [-1, 1])
    policy.set_action_stats(ActionStats.from_actions(demos.actions))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.sft.lr)
    generator = torch.Generator().manual_seed(seeds.generator(Purpose.SFT_SHUFFLE))
    steps_per_epoch = math.ceil(len(demos) / cfg.sft.batch_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    log = RunLogger(run_dir, cfg.sft.epochs * len(demos), progress=cfg.runner.progress)
    log.note("sft", f"{len(demos)} steps from {len(demos.seeds)} demos of {demos.task} ('{demos.instruction}')")
    targets = chunk_targets(demos.actions, demos.episode, cfg.policy.chunk_size)
    policy.train()
    stats: dict[str, float] = {}
    for epoch in range(cfg.sft.epochs):
        order = torch.randperm(len(demos), generator=generator)
        totals = {"loss": 0.0, "token_accuracy": 0.0}
        for start in range(0, len(demos), cfg.sft.batch_size):
            idx = order[start:start + cfg.sft.batch_size]
            step = sft_step(policy, optimizer, {k: v[idx] for k, v in demos.obs.items()}, targets[idx])
            for key in totals:
                totals[key] += step[key] / steps_per_epoch
            log.advance(len(idx))
        stats = {f"sft/{k}": v for k, v in totals.items()}
        log.scalars(stats, (epoch + 1) * len(demos))
    log.close()
    actor = {"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
             "generator": generator.get_state(), "torch_rng": torch.get_rng_state()}
    # RL has not started (Progress at zero): `train checkpoint=` warm-starts from here
    state = checkpoint_state(actor, Progress(), to_yaml(cfg), obs_spec, demos.actions.shape[-1],
                             sft={**stats, "demos": len(demos.seeds), "steps": len(demos), **asdict(cfg.sft)})
    save_checkpoint(run_dir, 0, state)
    return state["sft"]
