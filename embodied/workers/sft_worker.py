"""SftWorker: one of ``embodied sft``'s data-parallel ranks (``placement.actor_workers > 1``)."""

from __future__ import annotations

import torch

from embodied.algorithms.sft import SftTrainer, seeded_policy
from policies.vla.action_tokenizer import ActionStats
from scheduler.runtime.data_parallel import join_group, resolve_strategy
from scheduler.runtime.weight_sync import group_address
from scheduler.runtime.worker import Worker


class SftWorker(Worker):
    """Rank ``rank`` of ``world_size`` SFT ranks, on the actor group's devices. The ranks first
    meet in a process group (:meth:`group_address` on rank 0, then :meth:`start` on all at
    once), then run the same :meth:`epoch` calls on every demo (embodied/algorithms/sft.py)."""

    def __init__(self, policy_cfg, sft_cfg, obs_spec: dict, action_dim: int, action_stats: ActionStats,
                 seed: int, **kwargs):
        super().__init__(**kwargs)
        self.sft_cfg, self.seed = sft_cfg, seed
        self.policy = seeded_policy(policy_cfg, obs_spec, action_dim, action_stats, seed)
        self.trainer: SftTrainer | None = None

    def group_address(self) -> str:
        return group_address()

    def start(self, address: str, strategy: str, fsdp_from: int) -> str:
        """Join the ranks' group and build this rank's trainer with ``placement.data_parallel`` =
        ``strategy`` (``auto``: fsdp from ``fsdp_from`` = ``placement.fsdp_from_parameters``
        parameters on); returns the strategy it resolved to."""
        resolved = resolve_strategy(strategy, sum(p.numel() for p in self.policy.parameters()), fsdp_from)
        dp = join_group(address, self.rank, self.world_size, self.device, resolved)
        self.trainer = SftTrainer(self.policy, self.sft_cfg, self.seed, device=self.device, dp=dp)
        return resolved

    def epoch(self, obs: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, float]:
        return self.trainer.epoch(obs, targets)

    def state(self) -> dict | None:
        return self.trainer.state()
