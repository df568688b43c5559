"""Worker groups placed across Ray nodes: a head and a second node started with `ray start`
on this machine, one CPU slot and one custom resource each."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from embodied.config_files import file_overrides
from tests.conftest import REPO

pytestmark = pytest.mark.integration  # two local Ray nodes: not the fast tier

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], temp_dir: str, log: Path) -> subprocess.Popen:
    # no drain on SIGTERM (it waits up to 30 s), no token auth, nothing under ~/.ray
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    cmd = [RAY, "start", "--block", "--num-cpus=1", "--num-gpus=0", f"--temp-dir={temp_dir}",
           "--object-store-memory=300000000", "--disable-usage-stats", *args]
    # its own process group: teardown kills this cluster and nothing else (`ray stop` kills all)
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 90
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            _stop_node(proc)
            raise RuntimeError(f"ray start failed:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def _stop_node(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def two_nodes():
    """``address`` of a cluster: head (CPU slot = device 0, resource node_a) + node_b (device 1)."""
    base = tempfile.mkdtemp(prefix="r2n_", dir="/tmp")  # short: Unix socket paths are limited to 108 bytes
    port = _free_port()
    nodes = []
    try:
        nodes.append(_start_node(["--head", f"--port={port}", "--include-dashboard=false",
                                  f"--ray-client-server-port={_free_port()}", '--resources={"node_a": 1}'],
                                 f"{base}/a", Path(base) / "head.log"))
        nodes.append(_start_node([f"--address=127.0.0.1:{port}", '--resources={"node_b": 1}'],
                                 f"{base}/b", Path(base) / "b.log"))
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(nodes):
            _stop_node(proc)
        shutil.rmtree(base, ignore_errors=True)


def _probe(address: str, run_dir: Path, *overrides: str) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "tests.multinode_probe", address, str(run_dir), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("overrides, expected, weight_sync", [
    # all but the last are slow, for the suite's time: the last also splits a group over the nodes
    # env on the second node; rollout and actor on the head, sharing its slot
    pytest.param(["placement.mode=hybrid", "placement.env=1", "placement.rollout=0", "placement.actor=0"],
                 {"env": ["node_b"], "rollout": ["node_a"], "actor": ["node_a"]}, "shared_memory",
                 marks=pytest.mark.slow),
    # env and rollout on the second node, the actor on the head: weights cross nodes
    pytest.param(["placement.mode=colocated", "placement.env=1", "placement.rollout=1", "placement.actor=0"],
                 {"env": ["node_b"], "rollout": ["node_b"], "actor": ["node_a"]}, "object_store",
                 marks=pytest.mark.slow),
    pytest.param(["placement.mode=colocated", "placement.env=1", "placement.rollout=1", "placement.actor=0",
                  "placement.weight_sync=broadcast"],
                 {"env": ["node_b"], "rollout": ["node_b"], "actor": ["node_a"]}, "broadcast",
                 marks=pytest.mark.slow),
    # docs/multinode.md's recipe: two data-parallel actor ranks, one on each node, in one gloo group over
    # the nodes (FSDP2); envs and rollout on the second node
    (file_overrides(REPO / "docs/recipes/two_nodes.yaml"),
     {"env": ["node_b"], "rollout": ["node_b"], "actor": ["node_a", "node_b"]}, "object_store"),
], ids=["env-on-node-b", "actor-on-head-only", "broadcast-across-nodes", "recipe-actor-ranks-on-both-nodes"])
def test_groups_run_on_the_nodes_placement_names(two_nodes, tmp_path, overrides, expected, weight_sync):
    out = _probe(two_nodes, tmp_path, "placement.env_workers=1", *overrides)
    assert out["groups"] == expected
    assert out["weight_sync"] == weight_sync
    assert out["env_steps"] == 80 and out["episodes"] >= 4
