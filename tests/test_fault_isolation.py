"""Faults stay where they happen (issue 57): one worker SIGSTOPped mid-run, with a busy loop on every
core beside the run, is the one worker replaced; the workers that were blocked on it are judged by their
own pings, kept, and their episodes are not counted as failed; the restart budget is charged once.

Slow tier (two SAC runs of a few minutes each on 2 loaded cores). The default tier covers the
behaviour in seconds, in tests/test_faults.py:
``test_one_stopped_worker_is_named_hung_and_its_peers_blocked_on_it_are_kept`` (real Ray workers,
one SIGSTOPped, its peer blocked on the channel),
``test_pings_and_questions_run_in_their_own_concurrency_group_as_ray_reads_the_marks`` (the cause) and
``test_a_hang_is_traced_to_the_silent_worker_not_to_the_peers_blocked_on_it``; and in tests/test_recovery.py:
``test_one_hung_worker_charges_the_budget_once_and_fails_only_its_own_episodes``.
"""

from __future__ import annotations

import os

import pytest

from embodied.chaos import ChaosMonkey, Injection, cpu_contention
from embodied.trainer import Trainer
from tests.conftest import small_config

# SAC from state, 8 envs over 2 env workers, 4-step rollouts: 8 iterations of 32 env steps, an update in
# every one (learning_starts=0: the update's deadline is measured on real updates, not on the no-ops before
# learning starts). Deadlines that a loaded machine keeps (the calls run 2-5x slower beside the busy loops)
# and still find a hang within a minute. The actor updates on one thread: two OpenMP threads on cores
# that busy loops hold wait on each other at every operation (a 16-step update then outlived 20 s).
SAC = ["algorithm=sac", "policy=mlp_sac", "env.num_envs=8", "algorithm.rollout_steps=4",
       "runner.total_env_steps=256", "runner.eval_every=0", "runner.checkpoint_every=1000",
       "algorithm.sac.batch_size=32", "algorithm.sac.learning_starts=0", "algorithm.sac.buffer_size=10000",
       "placement.actor_threads=1", "runner.call_deadline_floor_s=20", "runner.call_deadline_factor=3",
       "runner.first_call_deadline_s=300", "runner.ping_timeout_s=10"]


@pytest.mark.slow
@pytest.mark.parametrize("target,collection", [("env", "sync"), ("rollout", "async")])
def test_a_stopped_worker_under_cpu_contention_is_the_only_one_replaced(ray_cluster, tmp_path, target, collection):
    cfg = small_config(f"runner.run_dir={tmp_path}", *SAC, f"runner.collection={collection}")
    trainer = Trainer(cfg, tmp_path)
    before = {group: trainer.workers.process_ids(group) for group in ("env", "rollout", "actor")}
    monkey = ChaosMonkey(trainer, [Injection(3, 0.5, target, 1, "stop")])
    try:
        with cpu_contention(len(os.sched_getaffinity(0))):
            monkey.start()
            summary = trainer.train()
            monkey.stop()
        after = {group: trainer.workers.process_ids(group) for group in ("env", "rollout", "actor")}
        restarts = {group: len(times) for group, times in trainer.faults.budget.restarts.items()}
    finally:
        monkey.stop()
        trainer.close()
    (shot,) = monkey.fired
    faults = summary["faults"]
    # one fault, the injected one, found as a hang: none of the workers blocked on it was named with it
    assert [(e["group"], e["pid"], e["kind"]) for e in faults["events"]] == [(target, shot.worker_pid, "hung")], faults
    assert "does not answer a ping" in faults["events"][0]["detail"]
    assert restarts == {target: 1}  # the budget charged once
    # the survivors kept their processes; only the stopped one was replaced
    for group, pids in before.items():
        kept = [pid for pid in pids if pid != shot.worker_pid]
        assert set(kept) <= set(after[group]) and shot.worker_pid not in after[group], (group, before, after)
    # only the stopped env worker's episodes failed (4 envs each); a stopped rollout worker fails none
    assert faults["episodes_failed"] == (trainer.workers.layout.envs_per_worker if target == "env" else 0)
    assert trainer.progress.iteration == trainer.total_iterations == 8
    assert summary["training"]["env_steps"] == 256
