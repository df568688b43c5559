"""How a run's envs are cut up, in one place: every role reads its slices from a BatchLayout.

``num_envs`` envs (the whole batch, env ``j`` numbered across it) are split over
``env_workers`` env worker ranks of ``envs_per_worker`` envs each, and each rank's slice into
``stages`` micro-batches (``placement.pipeline_stages``) of ``stage_size`` envs. Rollout
worker ``k`` of ``n`` serves the env ranks ``r`` with ``r % n == k``. With action chunks
(``chunk_size > 1``) one decision of an env is ``chunk_size`` simulator steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLayout:
    num_envs: int
    env_workers: int
    stages: int = 1
    chunk_size: int = 1  # simulator steps per decision

    @property
    def envs_per_worker(self) -> int:
        return self.num_envs // self.env_workers

    @property
    def stage_size(self) -> int:
        return self.envs_per_worker // self.stages

    def rank_slice(self, rank: int) -> slice:
        """Env worker ``rank``'s envs in the whole batch."""
        return slice(rank * self.envs_per_worker, (rank + 1) * self.envs_per_worker)

    def stage_slice(self, stage: int) -> slice:
        """Micro-batch ``stage``'s envs within a rank's slice."""
        return slice(stage * self.stage_size, (stage + 1) * self.stage_size)

    def per_rank(self, values: Sequence) -> list:
        """``values`` (one per env of the whole batch) cut into each env rank's slice."""
        return [values[self.rank_slice(r)] for r in range(self.env_workers)]

    def streams(self, rollout_rank: int, rollout_workers: int) -> list[tuple[int, int]]:
        """``(env rank, stage)`` of every micro-batch rollout worker ``rollout_rank`` serves, in
        the order it serves them each step."""
        ranks = [r for r in range(self.env_workers) if r % rollout_workers == rollout_rank]
        return [(r, s) for r in ranks for s in range(self.stages)]

    def env_steps(self, decisions: int) -> int:
        """Simulator steps of the whole batch in ``decisions`` decisions of every env."""
        return decisions * self.chunk_size * self.num_envs

    def evaluation_rounds(self, episodes: int) -> list[list[int]]:
        """Episode ids each env of the batch runs, round by round: env ``j`` runs the ``j``-th
        block of consecutive episodes (an env changing task mid-block, as LIBERO's, rebuilds its
        scene only at task borders); ``-1`` pads the last round (run, not reported)."""
        rounds = math.ceil(episodes / self.num_envs)
        return [[i if i < episodes else -1 for i in (j * rounds + k for j in range(self.num_envs))]
                for k in range(rounds)]

    def actor_shares(self, rollout_workers: int, actor_workers: int) -> list[tuple[list[int], slice]]:
        """What each actor rank trains on: the rollout ranks whose trajectories it reads and the
        envs to keep of their concatenation. The actor batch is the rollout workers'
        trajectories joined in rank order (worker ``k``'s has ``len(streams(k)) * stage_size``
        envs); actor rank ``a`` of ``actor_workers`` holds its ``a``-th block of equal width."""
        widths = [len(self.streams(k, rollout_workers)) * self.stage_size for k in range(rollout_workers)]
        starts = [sum(widths[:k]) for k in range(rollout_workers)]
        share = self.num_envs // actor_workers
        out = []
        for a in range(actor_workers):
            lo, hi = a * share, (a + 1) * share
            ranks = [k for k in range(rollout_workers) if starts[k] < hi and starts[k] + widths[k] > lo]
            out.append((ranks, slice(lo - starts[ranks[0]], hi - starts[ranks[0]])))
        return out
