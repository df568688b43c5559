"""Seed streams by purpose: every random number a run draws comes from (run seed, purpose).

Two kinds of streams:

* **Episode seeds** (what a simulator's ``reset(seed)`` gets) are 32-bit: ManiSkill seeds
  numpy's ``RandomState`` with them. The 32-bit space is cut into regions by purpose, so
  no two purposes can ever hand out the same seed::

      [0, 2^31)                protocol seeds the user names: evaluation (eval.seed + k,
                               1,000,000 + k by default) and demos (sft.demo_seed + k)
      [2^31, 2^31 + 2^30)      training resets: episode slot ``n = iteration * slots + slot``
      [2^31 + 2^30, +2^29)     auto-resets: env ``j`` (of ``E``) starting an episode at its
                               ``t``-th simulator step of the run: ``n = t * E + j``
      [2^32 - 2^29, 2^32)      validation episodes ``n = k``

  Inside a region of size ``2^b`` index ``n`` becomes ``base + (a * n + c) mod 2^b`` with
  ``a`` odd: a bijection, so distinct indices never share a seed (up to ``2^b`` indices:
  4,096 envs x 262,144 iterations of training resets). ``a`` and ``c`` come from
  ``numpy.random.SeedSequence([run seed, purpose])``: another run seed draws other episodes.

* **Generator seeds** (torch generators: weight init, rollout noise per env rank, minibatch
  order, SFT shuffling) are 64-bit draws of ``SeedSequence([run seed, purpose, *key])``.

A backend whose episodes are a fixed set of stored initial states (LIBERO: the benchmark's
50 per task are all there are) maps these seeds onto its own (see ``SeedScheme``); there,
training necessarily starts from the evaluation's initial states, as in every LIBERO RL work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

PROTOCOL_LIMIT = 2**31  # evaluation and demo seeds live below this


class Purpose(enum.IntEnum):
    """What a stream is for; the value is mixed into its SeedSequence (never reorder)."""

    TRAIN_RESET = 1
    AUTO_RESET = 2
    VALIDATION = 3
    INIT = 4  # policy weights
    ROLLOUT_NOISE = 5  # per env rank
    MINIBATCH = 6  # the actor's minibatch order
    SFT_SHUFFLE = 7
    EVAL_NOISE = 8  # per evaluation episode (stochastic evaluation)


@dataclass(frozen=True)
class Region:
    """``2**bits`` consecutive seeds from ``base``."""

    base: int
    bits: int

    @property
    def size(self) -> int:
        return 1 << self.bits

    def __contains__(self, seed: int) -> bool:
        return self.base <= seed < self.base + self.size


REGIONS = {
    Purpose.TRAIN_RESET: Region(2**31, 30),
    Purpose.AUTO_RESET: Region(2**31 + 2**30, 29),
    Purpose.VALIDATION: Region(2**32 - 2**29, 29),
}


def generator_seed(run_seed: int, purpose: Purpose, *key: int) -> int:
    """A 63-bit seed for a torch generator, one per (run seed, purpose, key)."""
    words = np.random.SeedSequence([int(run_seed), int(purpose), *map(int, key)]).generate_state(2)
    return int((int(words[0]) << 32 | int(words[1])) & (2**63 - 1))


def episode_noise_seed(episode_seed: int) -> int:
    """The noise of a stochastic evaluation episode: its own stream, named by its seed alone."""
    return generator_seed(episode_seed, Purpose.EVAL_NOISE)


@dataclass(frozen=True)
class EpisodeStream:
    """Episode seeds of one purpose: ``seed(n)`` is a bijection of ``n`` onto the purpose's region.

    Picklable (a few ints): env processes compute their auto-reset seeds from it.
    """

    region: Region
    multiplier: int  # odd
    offset: int

    @classmethod
    def of(cls, run_seed: int, purpose: Purpose) -> EpisodeStream:
        region = REGIONS[purpose]
        a, c = np.random.SeedSequence([int(run_seed), int(purpose)]).generate_state(2)
        mask = region.size - 1
        return cls(region, (int(a) & mask) | 1, int(c) & mask)

    def seed(self, index: int) -> int:
        """The ``index``-th episode seed (indices past the region's size wrap around)."""
        return self.region.base + ((self.multiplier * int(index) + self.offset) & (self.region.size - 1))

    def index_of(self, seeds: np.ndarray) -> np.ndarray:
        """The inverse of ``seeds``: which index each seed of this stream is (int64 array)."""
        inverse = np.uint64(pow(self.multiplier, -1, self.region.size))
        shifted = (np.asarray(seeds, dtype=np.int64) - self.region.base).astype(np.uint64)
        return ((shifted - np.uint64(self.offset)) * inverse & np.uint64(self.region.size - 1)).astype(np.int64)

    def seeds(self, indices: np.ndarray) -> np.ndarray:
        """``seed`` over an int64 array of indices (vectorized, exact: uint64 arithmetic wraps mod 2^64)."""
        n = np.asarray(indices, dtype=np.uint64)
        mixed = (np.uint64(self.multiplier) * n + np.uint64(self.offset)) & np.uint64(self.region.size - 1)
        return mixed.astype(np.int64) + self.region.base


@dataclass(frozen=True)
class AutoResets:
    """Seeds of the episodes a VecEnv starts by itself (after the last one ended).

    Env ``i`` of this VecEnv is env ``j = first_env + i`` of the whole batch (``num_envs``
    envs); an episode it starts after its ``t``-th simulator step of the run (``first_step``
    at its last reset, plus the steps since) gets index ``t * num_envs + j`` of ``stream``.
    Two episodes of one env never start at the same step, so auto-reset episodes never
    repeat each other (while ``t * num_envs`` stays under the region's 2^29).
    Picklable: env processes compute the seeds where the resets happen.
    """

    stream: EpisodeStream
    first_env: int
    num_envs: int
    first_step: int

    @classmethod
    def after(cls, seed: int) -> AutoResets:
        """What a VecEnv reset with ``seed`` alone uses (no run around it: tests, demos, videos)."""
        return cls(EpisodeStream.of(seed, Purpose.AUTO_RESET), 0, 1, 0)

    def seed(self, env: int, steps_since_reset: int) -> int:
        return self.stream.seed((self.first_step + steps_since_reset) * self.num_envs + self.first_env + env)

    def shifted(self, envs: int) -> AutoResets:
        """The same for a sub-batch starting ``envs`` further in (a process's or a stage's slice)."""
        return replace(self, first_env=self.first_env + envs)


@dataclass(frozen=True)
class RunSeeds:
    """Every stream of a run, from its ``runner.seed``."""

    run_seed: int

    @property
    def train_resets(self) -> EpisodeStream:
        """Index ``iteration * slots + slot``: episode slot ``slot`` (of ``slots``) reset at ``iteration``."""
        return EpisodeStream.of(self.run_seed, Purpose.TRAIN_RESET)

    @property
    def auto_resets(self) -> EpisodeStream:
        return EpisodeStream.of(self.run_seed, Purpose.AUTO_RESET)

    @property
    def validation(self) -> EpisodeStream:
        return EpisodeStream.of(self.run_seed, Purpose.VALIDATION)

    def generator(self, purpose: Purpose, *key: int) -> int:
        return generator_seed(self.run_seed, purpose, *key)
