"""BatchLayout: the one place a run's envs are cut into ranks, micro-batches and evaluation rounds."""

import itertools

import pytest

from scheduler.runtime.layout import BatchLayout

LAYOUTS = [BatchLayout(n, w, s, c) for n, w, s, c in itertools.product((8, 24), (1, 2, 4), (1, 2), (1, 8))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_ranks_and_stages_cut_the_batch_into_disjoint_covering_slices(layout):
    envs = list(range(layout.num_envs))
    assert sum(layout.per_rank(envs), []) == envs
    for rank_envs in layout.per_rank(envs):
        stages = [rank_envs[layout.stage_slice(s)] for s in range(layout.stages)]
        assert sum(stages, []) == rank_envs and all(len(s) == layout.stage_size for s in stages)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("rollout_workers", [1, 2, 3])
def test_rollout_workers_serve_every_micro_batch_once(layout, rollout_workers):
    served = [stream for k in range(rollout_workers) for stream in layout.streams(k, rollout_workers)]
    assert sorted(served) == [(r, s) for r in range(layout.env_workers) for s in range(layout.stages)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("episodes", [1, 7, 24, 100])
def test_evaluation_rounds_run_every_episode_once_in_consecutive_blocks(layout, episodes):
    rounds = layout.evaluation_rounds(episodes)
    ran = [i for ids in rounds for i in ids if i >= 0]
    assert sorted(ran) == list(range(episodes)) and all(len(ids) == layout.num_envs for ids in rounds)
    for env in range(layout.num_envs):  # env j runs consecutive episodes, padding only at the end
        own = [ids[env] for ids in rounds]
        real = [i for i in own if i >= 0]
        if real:
            assert real == list(range(real[0], real[0] + len(real)))
        assert own[:len(real)] == real


def test_env_steps_count_every_simulator_step_of_a_chunk():
    # what the trainer and `embodied bench pipeline` both report per iteration
    assert BatchLayout(num_envs=8, env_workers=2, stages=2, chunk_size=4).env_steps(decisions=5) == 5 * 4 * 8
