"""Shared fixtures: one real local Ray cluster per test session, small env configs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
warnings.filterwarnings("ignore", message=".*libvulkan.*")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster with 2 CPU slots, shared by the whole session."""
    from scheduler.cluster import start_cluster, stop_cluster

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
