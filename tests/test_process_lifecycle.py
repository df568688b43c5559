"""A run's processes end with it however it ends (SIGKILL included), and Ctrl-C stops a run in order:
a checkpoint, one line naming ``resume=``, exit 130; a second Ctrl-C at once (issue 57).

The processes of a run are found by its session: each run here starts with ``start_new_session``, as a
terminal starts a command, and Ray's processes keep that session id (its workers only make process
groups of their own), so what is left of a run is what is left in its session.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import REPO, SMALL_OVERRIDES, small_config

PROCESS_TIMEOUT = 120  # a whole run's start here takes 15-40 s on two busy cores


@pytest.fixture
def ray_tmp():
    """A short Ray temp dir (Ray's socket paths must fit 107 bytes: pytest's tmp_path is too long)."""
    path = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(ray_tmp: Path) -> dict:
    from scheduler.runtime.reaper import RUN_VAR

    env = {k: v for k, v in os.environ.items() if k != RUN_VAR}  # not this test session's cluster's token
    return dict(env, EMBODIED_RAY_TMP=str(ray_tmp), PYTHONWARNINGS="ignore")


def _in_session(sid: int) -> list[str]:
    """The live processes of session ``sid`` (zombies hold nothing), as 'pid name'."""
    left = []
    for p in psutil.process_iter(["name", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.info['name']}")
        except (OSError, psutil.Error):
            pass
    return left


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_gone(sid: int, within: float) -> list[str]:
    """Wait up to ``within`` s for session ``sid`` to have no process; returns what is still there."""
    deadline = time.monotonic() + within
    while (left := _in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def _kill_session(sid: int) -> None:
    """Clean up after a failed test: nothing of it may outlive the test."""
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
        except (OSError, psutil.Error):
            pass


# -- the reaper (scheduler/runtime/reaper.py) -------------------------------------------------------
DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    import psutil, ray
    from scheduler.runtime import cluster, reaper

    def session():
        me = os.getpid()
        return sorted(p.pid for p in psutil.process_iter() if p.pid != me and os.getsid(p.pid) == os.getsid(me)
                      and p.status() != psutil.STATUS_ZOMBIE)

    cluster.start_cluster(num_cpus=1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the driver's own
    cluster.stop_cluster()  # the normal path: ray.shutdown(), then the reaper ends what Ray left (and waits)
    normal = {"left": [p for p in session() if p != child.pid], "child_alive": child.poll() is None,
              "token": os.environ.get(reaper.RUN_VAR)}
    child.kill()
    child.wait()

    cluster.start_cluster(num_cpus=1)

    @ray.remote
    class Holder:  # a worker with a process of its own below it, as an env worker's simulator
        def __init__(self):
            self.sleeper = subprocess.Popen(["sleep", "120"])

        def pid(self):
            return self.sleeper.pid

    holder = Holder.remote()
    sleeper = ray.get(holder.pid.remote())
    print(json.dumps({"normal": normal, "sleeper": sleeper, "session": session()}), flush=True)
    time.sleep(300)
""")


@pytest.mark.integration  # a driver, its Ray cluster and a worker's child: not the fast tier
def test_a_local_cluster_ends_with_its_driver_also_when_the_driver_is_sigkilled(ray_tmp):
    """SIGKILL leaves Ray's DashboardAgent and RuntimeEnvAgent under PID 1 for good, and any process a
    worker started; the reaper ends them all. Before that, the same driver's ray.shutdown() path: the
    cluster leaves nothing, and the reaper spares a child the driver started itself."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, env=_env(ray_tmp), start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line, driver.stderr.read()[-3000:]
        report = json.loads(line)
        assert report["normal"] == {"left": [], "child_alive": True, "token": None}
        names = {psutil.Process(pid).name() for pid in report["session"] if psutil.pid_exists(pid)}
        assert {"raylet", "gcs_server"} <= names and _alive(report["sleeper"]), names
        driver.kill()
        driver.wait()
        assert _all_gone(driver.pid, within=15) == []
        assert not _alive(report["sleeper"])
        logs = list(ray_tmp.glob("session_2*/logs/embodied_reaper.log"))
        assert len(logs) == 1 and "the driver is gone" in logs[0].read_text()
    finally:
        _kill_session(driver.pid)


JOINER = textwrap.dedent("""
    import json, os, sys
    from scheduler.runtime import cluster, reaper

    address = sys.argv[1]
    os.environ["RAY_ADDRESS"] = address  # ray.init() without an address joins it: not a cluster of ours
    try:
        cluster.start_cluster()
        via_env = "joined"
    except Exception as err:
        via_env = type(err).__name__
    via_env_reaper = cluster._reaper is not None or reaper.RUN_VAR in os.environ
    del os.environ["RAY_ADDRESS"]
    cluster.stop_cluster()
    cluster.start_cluster(address=address)
    print(json.dumps({"via_env": via_env, "via_env_reaper": via_env_reaper,
                      "reaper": cluster._reaper is not None or reaper.RUN_VAR in os.environ}), flush=True)
    os._exit(0)  # no ray.shutdown(): as if killed
""")


def test_a_driver_that_joins_a_cluster_leaves_that_cluster_running_when_it_ends(ray_cluster, ray_tmp):
    import ray

    from scheduler.runtime.cluster import _reaper as ours

    address = ray.get_runtime_context().gcs_address
    def heads() -> set[int]:  # this test session's cluster's (the driver, this process, started them)
        return {p.pid for p in psutil.Process().children() if p.name() in ("raylet", "gcs_server")}

    before = heads()
    assert len(before) == 2
    proc = subprocess.run([sys.executable, "-c", JOINER, address], cwd=REPO, env=_env(ray_tmp),
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert not report["via_env_reaper"] and not report["reaper"], report
    time.sleep(3)  # what a reaper would have had to act
    assert heads() == before
    assert ray.get(ray.remote(lambda: 7).remote(), timeout=60) == 7
    assert ours is None or ours.popen.poll() is None  # this session's own reaper is still on watch


# -- Ctrl-C (embodied/interrupts.py) ------------------------------------------------------------------
@pytest.mark.unit
def test_a_first_ctrl_c_raises_at_once_outside_and_after_the_block_inside_finishing(capfd):
    from embodied import interrupts

    with interrupts.handled():
        interrupts.set_hint(lambda: "the newest checkpoint is ckpt_000003.pt")
        with pytest.raises(KeyboardInterrupt) as raised:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # not reached
        assert interrupts.stopped_line(raised.value) == "interrupted: the newest checkpoint is ckpt_000003.pt"
    with interrupts.handled():
        done = []
        with pytest.raises(KeyboardInterrupt):
            with interrupts.finishing():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done.append("the update")  # held: the block runs to its end
            done.append("the rest")  # raised before this
        assert done == ["the update"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "Ctrl-C again stops at once" in capfd.readouterr().err


@pytest.mark.integration
def test_a_second_ctrl_c_exits_130_at_once_naming_what_is_kept(tmp_path):
    script = textwrap.dedent("""
        import os, signal, time
        from embodied import interrupts
        with interrupts.handled():
            interrupts.set_hint(lambda: "the newest checkpoint is ckpt_000003.pt")
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)  # during the clean-up
                time.sleep(5)
        print("not reached")
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and time.monotonic() - started < 5 and "not reached" not in proc.stdout
    assert "Ctrl-C again: stopped at once: the newest checkpoint is ckpt_000003.pt" in proc.stderr


def test_ctrl_c_during_the_update_counts_it_and_checkpoints_weights_and_iteration_together(ray_cluster, tmp_path):
    """The actor's update goes on in its process when the driver is interrupted: the checkpoint then
    holds the updated weights, so it must count that iteration (and does: the Ctrl-C waits for it)."""
    from embodied import interrupts
    from embodied.checkpoint import load_checkpoint
    from embodied.trainer import Trainer

    cfg = small_config(f"runner.run_dir={tmp_path}", "env.num_envs=2", "placement.env_workers=1",
                       "runner.total_env_steps=400", "runner.checkpoint_every=100")
    trainer = Trainer(cfg, tmp_path)
    try:
        before = trainer.workers.actor.call("get_weights")[0]
        update = trainer.workers.update

        def interrupted_update(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the update starts
            return update(*args, **kwargs)

        trainer.workers.update = interrupted_update
        with pytest.raises(interrupts.Interrupted) as raised:
            trainer.train()
        after = trainer.workers.actor.call("get_weights")[0]
    finally:
        trainer.close()
    assert raised.value.line == (f"interrupted at iteration 1: checkpoint ckpt_000001.pt written; "
                                 f"continue with `embodied train resume={tmp_path}`")
    state = load_checkpoint(tmp_path)
    assert state["progress"]["iteration"] == 1 and state["progress"]["env_steps"] == trainer.steps_per_iteration
    assert state["actor"]["policy"].keys() == after.keys()
    assert all(torch.equal(state["actor"]["policy"][k], after[k]) for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)  # the update happened, and is counted


# -- whole runs, as a user starts and stops them --------------------------------------------------------
TRAIN = ["train", *SMALL_OVERRIDES, "runner.total_env_steps=1000000", "runner.checkpoint_every=3", "ray.num_cpus=2"]


def _start_train(tmp_path: Path, ray_tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "embodied.cli", *TRAIN, f"runner.run_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=_env(ray_tmp), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_a_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + PROCESS_TIMEOUT
    while not (run_dir / "checkpoints" / "latest.json").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_training_run_killed_with_sigkill_leaves_no_process(tmp_path, ray_tmp):
    """~45 s. The default tier's test_a_local_cluster_ends_with_its_driver_also_when_the_driver_is_sigkilled
    covers the same reaper on a bare cluster."""
    proc = _start_train(tmp_path, ray_tmp)
    try:
        _wait_for_a_checkpoint(proc, tmp_path / "run")
        assert len(_in_session(proc.pid)) >= 8  # the driver, gcs_server, the raylet, its agents, the workers
        proc.kill()
        proc.communicate()
        assert _all_gone(proc.pid, within=15) == []
    finally:
        _kill_session(proc.pid)


@pytest.mark.slow
@pytest.mark.e2e
def test_ctrl_c_checkpoints_names_resume_exits_130_and_the_run_resumes(tmp_path, ray_tmp):
    """~95 s. Ctrl-C as a terminal sends it: to the whole foreground process group. The default tier's
    test_ctrl_c_during_the_update_counts_it_and_checkpoints_weights_and_iteration_together and the
    interrupts tests cover the same path without the process start."""
    from embodied.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    proc = _start_train(tmp_path, ray_tmp)
    try:
        _wait_for_a_checkpoint(proc, run_dir)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=PROCESS_TIMEOUT)
        assert proc.returncode == 130, err[-3000:]
        assert "Traceback" not in err
        named = [line for line in err.splitlines() if "resume=" in line]
        assert len(named) == 1 and named[0].endswith(f"continue with `embodied train resume={run_dir}`"), err[-3000:]
        assert _all_gone(proc.pid, within=15) == []
    finally:
        _kill_session(proc.pid)
    state = load_checkpoint(run_dir)
    iteration = state["progress"]["iteration"]
    assert f"interrupted at iteration {iteration}:" in named[0]
    steps = state["progress"]["env_steps"]
    resumed = subprocess.run([sys.executable, "-m", "embodied.cli", "train", f"resume={run_dir}",
                              f"runner.total_env_steps={steps + 2 * 40}"], cwd=REPO, env=_env(ray_tmp),
                             capture_output=True, text=True, timeout=PROCESS_TIMEOUT * 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_checkpoint(run_dir)["progress"]["iteration"] == iteration + 2


@pytest.mark.slow
@pytest.mark.e2e
def test_a_second_ctrl_c_stops_the_run_at_once_and_leaves_no_process(tmp_path, ray_tmp):
    """~40 s. The default tier's test_a_second_ctrl_c_exits_130_at_once_naming_what_is_kept covers the
    exit, test_a_local_cluster_ends_with_its_driver_also_when_the_driver_is_sigkilled what ends the
    cluster after it."""
    proc = _start_train(tmp_path, ray_tmp)
    try:
        _wait_for_a_checkpoint(proc, tmp_path / "run")
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        _, err = proc.communicate(timeout=PROCESS_TIMEOUT)
        assert proc.returncode == 130 and time.monotonic() - started < 5, err[-3000:]
        assert "Ctrl-C again: stopped at once: the newest checkpoint is ckpt_" in err
        assert _all_gone(proc.pid, within=15) == []
    finally:
        _kill_session(proc.pid)
