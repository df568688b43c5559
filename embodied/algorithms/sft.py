"""Supervised fine-tuning on demos: minibatches of the policy's own demo loss (``Policy.demo_loss``:
for token policies, cross-entropy over the demo actions' tokens).

Read top to bottom: :func:`chunk_targets` (what each demo step teaches), :class:`SftTrainer`
(the policy, its optimizer and the shuffle stream of one SFT rank) and its :meth:`epoch`
(minibatches of the policy's demo loss).

On ``placement.actor_workers`` ranks (``embodied/workers/sft_worker.py``) every rank holds
every demo and draws the same shuffle; each minibatch's rows are split over the ranks in
contiguous blocks and each rank's loss is weighted by its share, so the summed gradient, and
the step, are one rank's (``scheduler/runtime/data_parallel.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from envs.seeds import Purpose, RunSeeds
from policies.registry import make_policy
from policies.vla.action_tokenizer import ActionStats
from scheduler.runtime.data_parallel import SINGLE, DataParallel


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


def rank_rows(idx: torch.Tensor, dp: DataParallel) -> tuple[torch.Tensor, float]:
    """This rank's rows of minibatch ``idx [B]`` (a contiguous block) and their share of it. A
    rank left without rows (``B < world``) trains its first row at weight 0: every rank runs
    the same passes (FSDP's collectives are in them) and adds nothing."""
    mine = idx.tensor_split(dp.world)[dp.rank]
    if len(mine) == 0:
        return idx[:1], 0.0
    return mine, len(mine) / len(idx)


def seeded_policy(policy_cfg, obs_spec: dict, action_dim: int, action_stats: ActionStats, seed: int) -> nn.Module:
    """The policy SFT starts from: the run's initial weights (the same on every rank), its bins
    spanning the demos' actions."""
    torch.manual_seed(RunSeeds(seed).generator(Purpose.INIT))
    policy = make_policy(policy_cfg, obs_spec, action_dim)
    # OpenVLA's fine-tuning recipe: the new dataset's q01 / q99 map to the ends of the 256 bins, so
    # the bins resolve the range the demos use (joint deltas of a slow planner span a few % of [-1, 1])
    policy.set_action_stats(action_stats)
    return policy


class SftTrainer:
    """One SFT rank: ``policy`` (sharded or replicated as ``dp`` says, on ``device``), its Adam
    optimizer and the minibatch shuffle (the same stream on every rank)."""

    def __init__(self, policy: nn.Module, sft_cfg, seed: int, device: torch.device | None = None,
                 dp: DataParallel = SINGLE):
        self.dp, self.batch_size, self.device = dp, sft_cfg.batch_size, device or torch.device("cpu")
        self.policy = dp.wrap(policy.to(self.device))
        self.optimizer = torch.optim.Adam([p for p in self.policy.parameters() if p.requires_grad], lr=sft_cfg.lr)
        self.generator = torch.Generator().manual_seed(RunSeeds(seed).generator(Purpose.SFT_SHUFFLE))

    def step(self, obs: dict, targets: torch.Tensor, share: float = 1.0) -> dict[str, float]:
        """One gradient step of the policy's demo loss on ``targets [B, chunk_size, A]`` (this rank's
        rows: ``share`` of the minibatch); returns this rank's means of its ``demo_statistics``."""
        stats = self.policy.demo_loss(obs, targets)
        loss = stats["loss"]
        self.optimizer.zero_grad(set_to_none=True)
        weight = share * self.dp.loss_scale
        (loss if weight == 1.0 else loss * weight).backward()
        self.dp.sum_gradients(self.policy)
        self.optimizer.step()
        return {k: float(v) for k, v in stats.items()}

    def epoch(self, obs: dict[str, torch.Tensor], targets: torch.Tensor, advance=None) -> dict[str, float]:
        """One shuffled pass over the demos (``obs`` ``[N, ...]`` per key, ``targets
        [N, chunk_size, A]``); returns the means over its minibatches of the policy's ``demo_statistics``.
        ``advance(rows)`` (if given) after each minibatch: a progress bar."""
        self.policy.train()
        n = len(targets)
        order = torch.randperm(n, generator=self.generator)
        starts = range(0, n, self.batch_size)
        names = self.policy.demo_statistics
        totals = torch.zeros(len(names), dtype=torch.float64)
        for start in starts:
            idx = order[start:start + self.batch_size]
            rows, share = rank_rows(idx, self.dp)
            step = self.step({k: v[rows].to(self.device) for k, v in obs.items()}, targets[rows].to(self.device),
                             share)
            totals += torch.tensor([step[k] * share for k in names], dtype=torch.float64)
            if advance is not None:
                advance(len(idx))
        totals = self.dp.sum(totals) / len(starts)  # every rank's shares: the means of one rank holding all
        return dict(zip(names, totals.tolist(), strict=True))

    def state(self) -> dict | None:
        """The whole training state a checkpoint keeps (``train checkpoint=`` warm-starts from it)
        on rank 0; None elsewhere. Every rank calls (FSDP gathers the shards)."""
        state = {"policy": self.dp.whole_state(self.policy),
                 "optimizer": self.dp.full_optimizer_state(self.policy, self.optimizer),
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state()}
        return state if self.dp.rank == 0 else None
