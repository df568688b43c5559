"""Shared fixtures: one real local Ray cluster per test session, small env configs."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
warnings.filterwarnings("ignore", message=".*libvulkan.*")
torch.set_num_threads(1)


TIERS = ("unit", "integration", "e2e")
WHOLE_COMMANDS = ("run_cli(", "cli_main(", "main([")  # a test that runs `embodied <command>` is end to end


def tier(item) -> str:
    """A test's tier: its own marker (or its module's ``pytestmark``), else ``e2e`` if it runs a whole
    command, ``integration`` if it uses the Ray cluster, ``unit`` otherwise. A unit test starts no
    process (:func:`_unit_tests_start_no_process` fails one that does)."""
    marked = [m.name for m in item.iter_markers() if m.name in TIERS]  # the closest first
    if marked:
        return marked[0]
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        source = ""
    if any(call in source for call in WHOLE_COMMANDS):
        return "e2e"
    return "integration" if "ray_cluster" in item.fixturenames else "unit"


@pytest.hookimpl(tryfirst=True)  # before -m selects by the tier markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier(item))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request):
    """Keeps the fast tier fast: a unit test that leaves a new child process (Ray, a simulator, a
    subprocess) behind or ran one fails, naming the marker to give it."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [f"{p.pid} {_name(p)}" for p in me.children(recursive=True) if p.pid not in before]
    assert not new, (f"this unit test started processes ({', '.join(new)}); mark it "
                     "@pytest.mark.integration (or e2e) so `pytest -m unit` stays the fast tier")


def _name(process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster with 2 CPU slots, shared by the whole session."""
    from scheduler.runtime.cluster import start_cluster, stop_cluster

    os.environ["EMBODIED_RAY_TMP"] = str(tmp_path_factory.mktemp("ray"))
    resources = start_cluster(num_cpus=2)
    yield resources
    stop_cluster()


SMALL_OVERRIDES = [
    "env.num_envs=4", "placement.env_workers=2", "algorithm.rollout_steps=10",
    "algorithm.update_epochs=2", "algorithm.num_minibatches=2", "runner.total_env_steps=80",
    "runner.max_minutes=null", "runner.eval_every=0", "runner.checkpoint_every=1",
    "runner.progress=false", "eval.episodes=4", "eval.video_episodes=0",
]


def small_config(*overrides: str):
    """The default config, shrunk for tests (few envs, short rollouts)."""
    from embodied.config import compose

    return compose([*SMALL_OVERRIDES, *overrides])


def train_between_weights(cfg, run_dir: Path) -> tuple[dict, dict, dict]:
    """Train ``cfg`` to its end with a real :class:`~embodied.trainer.Trainer` in ``run_dir``; returns
    ``(actor weights before, the final summary, weights after)``. The workers are shut down either way."""
    from embodied.trainer import Trainer

    trainer = Trainer(cfg, run_dir)
    try:
        before = trainer.workers.actor.call("get_weights")[0]
        summary = trainer.train()
        return before, summary, trainer.workers.actor.call("get_weights")[0]
    finally:
        trainer.close()


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every TensorBoard scalar ``tag`` a run wrote under ``run_dir/tb``."""
    from embodied.run_logger import read_scalars

    return read_scalars(run_dir, tag)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``embodied <args>`` in a fresh process, as a user would."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "embodied.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


def assert_identical(a, b, path: str = "value") -> None:
    """Nested dicts / lists / dataclasses / tensors equal bit for bit (same dtype and device); names the
    first difference."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), path
        fields = [f.name for f in dataclasses.fields(a)]
        assert_identical({k: getattr(a, k) for k in fields}, {k: getattr(b, k) for k in fields}, path)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.device == b.device, path
        assert torch.equal(a, b), f"{path} differs (max diff {(a.double() - b.double()).abs().max()})"
    else:
        assert a == b, path
