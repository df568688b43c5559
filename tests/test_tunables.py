"""Tunables that used to be constants in the code are config keys (embodied/config.py): each reaches
the code it sets. Cheap checks with fakes, no Ray or simulator; the key's range is checked by
tests/test_config.py, env.startup_timeout_s's deadline by tests/test_subproc.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from embodied.checkpoint import Progress, resolve_checkpoint, save_checkpoint
from embodied.config import TrainConfig
from scheduler.runtime.data_parallel import resolve_strategy


def _save(run_dir: Path, iterations: range, keep: int) -> list[str]:
    for iteration in iterations:
        save_checkpoint(run_dir, iteration, {"iteration": iteration}, keep=keep)
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*.pt"))


def test_keep_checkpoints_keeps_that_many_of_the_newest(tmp_path):
    assert _save(tmp_path / "one", range(1, 5), keep=1) == ["ckpt_000004.pt"]
    assert resolve_checkpoint(tmp_path / "one").name == "ckpt_000004.pt"
    assert json.loads((tmp_path / "one" / "checkpoints" / "latest.json").read_text()) == {"file": "ckpt_000004.pt"}
    assert _save(tmp_path / "three", range(1, 6), keep=3) == [f"ckpt_00000{i}.pt" for i in (3, 4, 5)]


class _FakeWorkers:
    obs_spec = {"state": ((3,), "float32")}
    action_dim = 1

    def __init__(self, success: float = 0.0):
        self.success = success

    def actor_state(self) -> dict:
        return {"policy": {}}

    def evaluate(self, seeds: list[int], deterministic: bool):
        return [{"success_once": self.success, "success_at_end": 0.0, "return": 1.0} for _ in seeds], {}


def _trainer(cfg: TrainConfig, run_dir: Path, success: float = 0.0):
    from embodied.collection import LockstepCollector
    from embodied.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # its parts, without workers
    trainer.cfg, trainer.run_dir, trainer.progress = cfg, run_dir, Progress()
    trainer.workers, trainer.episodic = _FakeWorkers(success), True
    trainer.collector = LockstepCollector(trainer.workers)
    trainer.log = SimpleNamespace(scalars=lambda values, step: None)
    return trainer


def test_a_training_run_keeps_runner_keep_checkpoints(tmp_path):
    cfg = TrainConfig()
    cfg.runner.keep_checkpoints = 2
    trainer = _trainer(cfg, tmp_path)
    for iteration in range(1, 5):
        trainer.progress.iteration = iteration
        trainer.save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000004.pt"]


@pytest.mark.parametrize(("solved_success", "success", "solved"), [(0.9, 0.85, False), (0.8, 0.85, True),
                                                                   (0.9, 0.9, True)])
def test_the_run_is_solved_at_the_first_validation_reaching_runner_solved_success(solved_success, success, solved):
    cfg = TrainConfig()
    cfg.runner.solved_success, cfg.runner.validation_episodes = solved_success, 4
    trainer = _trainer(cfg, Path("unused"), success)
    trainer.progress.train_seconds = 60.0
    assert trainer._periodic_eval(elapsed=6.0) == success
    assert trainer.progress.solved_at_seconds == (66.0 if solved else None)


def test_recovery_waits_runner_recovery_settle_s_for_the_survivors(monkeypatch):
    import embodied.runner as runner
    from scheduler.runtime.worker import WorkerFailure

    settled = []
    monkeypatch.setattr(runner, "Channel", lambda name: SimpleNamespace(close=lambda: None))
    workers = runner.Workers.__new__(runner.Workers)  # its parts, without a cluster
    workers.cfg = TrainConfig()
    workers.cfg.runner.recovery_settle_s = 7.5
    workers.groups, workers.channel = {}, SimpleNamespace(close=lambda: None)
    workers.watchdog = SimpleNamespace(settle=lambda timeout_s: settled.append(timeout_s) or [])
    workers.switcher = SimpleNamespace(workers_replaced=lambda: None)
    assert workers.recover(WorkerFailure("rollout", [], "stalled")) == []
    assert settled == [7.5]


def test_fsdp_from_parameters_is_where_auto_starts_sharding():
    from scheduler.auto import workload_of

    assert resolve_strategy("auto", 99_999_999) == "replicate"  # the default, for callers without a config
    assert resolve_strategy("auto", 100_000_000) == "fsdp"
    assert resolve_strategy("auto", 1_000, fsdp_from=1_000) == "fsdp"
    assert resolve_strategy("replicate", 10**12, fsdp_from=1) == "replicate"  # only auto asks
    cfg = TrainConfig()
    profile = SimpleNamespace(parameters=5_000, episode_steps=50)
    algorithm = SimpleNamespace(group_size=1, max_actor_ranks=None)
    assert not workload_of(cfg, profile, algorithm).sharded
    cfg.placement.fsdp_from_parameters = 5_000
    assert workload_of(cfg, profile, algorithm).sharded
