"""Seed streams by purpose (envs/seeds.py): disjoint regions, bijective streams, and the
guarantee users rely on, computed at GPU scale: for 4,096 envs and 100,000 iterations no
training initial state is an evaluation or validation one, and no two iterations share one."""

import numpy as np
import pytest

from embodied.config import compose
from envs.common import UserError
from envs.registry import seed_scheme, training_reset_seeds, validation_seeds
from envs.seeds import PROTOCOL_LIMIT, REGIONS, AutoResets, EpisodeStream, Purpose, Region, RunSeeds

ENVS, ITERATIONS = 4096, 100_000


def test_regions_are_disjoint_and_above_the_protocol_seeds():
    spans = sorted((r.base, r.base + r.size) for r in REGIONS.values())
    assert spans[0][0] >= PROTOCOL_LIMIT and spans[-1][1] <= 2**32  # ManiSkill seeds are 32-bit
    assert all(a[1] <= b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))


@pytest.mark.parametrize("run_seed", [0, 1, 12345])
def test_a_stream_is_a_bijection_of_its_region(run_seed):
    """Exhaustively, on a 2^16 region built like the real ones (odd multiplier, SeedSequence keys)."""
    a, c = np.random.SeedSequence([run_seed, 1]).generate_state(2)
    stream = EpisodeStream(Region(7, 16), (int(a) & 0xFFFF) | 1, int(c) & 0xFFFF)
    seeds = stream.seeds(np.arange(2**16))
    assert sorted(seeds.tolist()) == list(range(7, 7 + 2**16))
    assert [stream.seed(n) for n in (0, 1, 65535)] == seeds[[0, 1, 65535]].tolist()  # scalar == vectorized
    np.testing.assert_array_equal(stream.index_of(seeds), np.arange(2**16))


def _check_stream(stream: EpisodeStream, count: int, chunk: int = 1 << 20) -> None:
    """Seeds of indices 0..count-1 all lie in the stream's region and map back to their own
    index (so no two are equal), computed chunk by chunk."""
    for start in range(0, count, chunk):
        index = np.arange(start, min(start + chunk, count), dtype=np.int64)
        seeds = stream.seeds(index)
        assert seeds.min() >= stream.region.base and seeds.max() < stream.region.base + stream.region.size
        assert (stream.index_of(seeds) == index).all()


def test_training_never_draws_an_evaluation_or_validation_episode_and_iterations_never_repeat():
    run = RunSeeds(1)
    cfg = compose([])
    # training resets: slot n = iteration * slots + slot, every (iteration, slot) of the run
    assert ITERATIONS * ENVS <= REGIONS[Purpose.TRAIN_RESET].size
    _check_stream(run.train_resets, ITERATIONS * ENVS)
    assert training_reset_seeds(cfg.env, run, 7, ENVS)[5] == run.train_resets.seed(7 * ENVS + 5)
    # auto-resets: env j starting an episode after its t-th step, n = t * envs + j (the first
    # 16,384 steps of every env here: the stream is the same bijection as above)
    _check_stream(run.auto_resets, 16_384 * ENVS)
    auto = AutoResets(run.auto_resets, first_env=0, num_envs=ENVS, first_step=100).shifted(2048)
    assert auto.seed(3, steps_since_reset=7) == run.auto_resets.seed(107 * ENVS + 2048 + 3)
    # validation and the published evaluation seeds: their own regions
    validation = validation_seeds(cfg.env, run, 10_000)
    assert all(s in REGIONS[Purpose.VALIDATION] for s in validation) and len(set(validation)) == 10_000
    evaluation = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    assert evaluation == list(range(1_000_000, 1_000_100)) and max(evaluation) < PROTOCOL_LIMIT


def test_run_seeds_and_purposes_give_other_streams():
    cfg = compose([]).env
    assert training_reset_seeds(cfg, RunSeeds(1), 0, 64) != training_reset_seeds(cfg, RunSeeds(2), 0, 64)
    assert len({RunSeeds(1).generator(p) for p in Purpose}) == len(Purpose)
    assert RunSeeds(1).generator(Purpose.ROLLOUT_NOISE, 0) != RunSeeds(1).generator(Purpose.ROLLOUT_NOISE, 1)
    assert RunSeeds(1).generator(Purpose.INIT) == RunSeeds(1).generator(Purpose.INIT)


def test_grpo_groups_share_a_seed_and_groups_differ():
    seeds = training_reset_seeds(compose([]).env, RunSeeds(3), iteration=2, num_envs=8, group_size=4)
    assert seeds[:4] == [seeds[0]] * 4 and seeds[4:] == [seeds[4]] * 4 and seeds[0] != seeds[4]


def test_an_eval_seed_outside_the_protocol_seeds_is_a_config_error():
    cfg = compose(["eval.seed=2147483600"])
    with pytest.raises(UserError, match="eval.seed=2147483600"):
        seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
