"""A run survives its workers: real Ray, real ManiSkill, real signals.

A worker killed (SIGKILL) or stopped (SIGSTOP) mid-run is found, replaced, and the run completes
its iterations and its final evaluation; beyond the restart budget it stops with exit code 4, a
checkpoint written then, and a message. Plus the pure logic: deadlines, the budget's window, the
chaos schedule.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from types import SimpleNamespace

import cloudpickle
import pytest

import tests.test_faults as this_module
from embodied.chaos import ChaosMonkey, Injection, draw_schedule, markdown, report
from embodied.checkpoint import load_checkpoint
from embodied.trainer import Trainer
from embodied.workers.env_worker import EnvWorker
from scheduler.runtime.channel import Channel
from scheduler.runtime.faults import Deadlines, RestartBudget, Watchdog, WorkerFailure, judge_hung
from scheduler.runtime.worker import CONTROL_METHODS, Worker, WorkerGroup, _actor_class, control_methods
from tests.conftest import SMALL_OVERRIDES, run_cli, small_config

# Ray workers cannot import the tests package: ship this module's classes by value
cloudpickle.register_pickle_by_value(this_module)

# 6 iterations of 40 env steps; quick deadlines, so a stopped worker is found in seconds
FAULTY = ["runner.total_env_steps=240", "runner.checkpoint_every=2", "runner.call_deadline_floor_s=4",
          "runner.call_deadline_factor=3"]


def test_a_deadline_is_a_multiple_of_the_slowest_recent_call_above_a_floor():
    deadlines = Deadlines(floor_s=10, factor=4, first_s=600)
    assert deadlines.of("rollout") == 600  # never measured: the start-up deadline
    deadlines.record("rollout", 1.0)
    assert deadlines.of("rollout") == 10  # 4 x 1 s is under the floor
    deadlines.record("rollout", 5.0)
    deadlines.record("rollout", 2.0)
    assert deadlines.of("rollout") == 20  # the slowest recent call sets it
    assert Deadlines(10, 4, 600, fixed_s=7).of("rollout") == 7  # runner.call_deadline_s overrides


def test_the_restart_budget_counts_restarts_per_group_within_its_window():
    now = [0.0]
    budget = RestartBudget(limit=2, window_s=100, clock=lambda: now[0])
    assert [budget.spend("env") for _ in range(3)] == [1, 2, 3]  # the third is over the limit of 2
    assert budget.spend("actor") == 1  # groups are counted apart
    now[0] = 150.0
    assert budget.spend("env") == 1  # the window has passed


def test_pings_and_questions_run_in_their_own_concurrency_group_as_ray_reads_the_marks():
    """Issue 57: wrapped with functools.wraps, the marks sat on a wrapper Ray unwraps, so a ping waited
    behind the running call and every worker blocked on a hung peer was taken for hung too. The
    answering itself, on real Ray workers: the next test."""
    assert control_methods(_actor_class(Blocked)) == dict.fromkeys(CONTROL_METHODS, "control")
    # a subclass's own quick questions join them: chaos asks an env worker mid-rollout for its simulators
    env_worker = control_methods(_actor_class(EnvWorker))
    assert env_worker == dict.fromkeys((*CONTROL_METHODS, "simulator_pids"), "control")


def test_a_hang_is_traced_to_the_silent_worker_not_to_the_peers_blocked_on_it():
    alive = {("env", 0): "alive", ("rollout", 0): "alive", ("actor", 0): "alive"}
    stopped = {**alive, ("env", 1): "silent"}
    busy = {("env", 0), ("env", 1), ("rollout", 0)}
    # the stopped env worker is the hang; env rank 0 and the rollout worker wait on it and answer
    assert judge_hung(stopped, busy, {}, known=set()) == [(("env", 1), "it does not answer a ping")]
    # nobody silent: the one stuck in its own work (a simulator step), not those waiting on it
    waiting = {("env", 0): True, ("env", 1): False, ("rollout", 0): True}
    assert judge_hung({**alive, ("env", 1): "alive"}, busy, waiting, known=set()) == \
        [(("env", 1), "busy in its own work, not waiting on a peer")]
    # every busy worker waits on a peer: the call stalled between them, no worker at fault
    assert judge_hung({**alive, ("env", 1): "alive"}, busy, dict.fromkeys(busy, True), known=set()) == []
    # a worker already named (dead) is not named again
    assert judge_hung(stopped, busy, {}, known={("env", 1)}) == []


def test_the_chaos_report_names_the_workers_a_fault_took_with_it():
    from embodied.chaos import Injected

    shot = Injected(Injection(3, 0.5, "env", 1, "stop"), pid=11, worker_pid=11, unix_time=0.0, iteration=3)
    event = {"pid": 11, "group": "env", "rank": 1, "kind": "hung", "call": "rollout", "action": "replaced",
             "recovery_s": 20.0, "iterations_lost": 0, "recovery": 0, "detected_at": 45.0}
    survivor = {**event, "pid": 12, "rank": 0}
    isolated = report([shot], [shot.injection], {"count": 1, "events": [event], "episodes_failed": 16})
    assert isolated["collateral"] == 0 and isolated["injections"][0]["others_replaced"] == []
    assert isolated["injections"][0]["detected_after_s"] == 45.0
    assert "| none |" in markdown(isolated) and "16 episodes failed" in markdown(isolated)
    cascade = report([shot], [shot.injection], {"count": 2, "events": [event, survivor], "episodes_failed": 32})
    assert cascade["collateral"] == 1 and cascade["injections"][0]["others_replaced"] == ["env 0 (hung)"]


class _Between:
    """A trainer as the monkey sees it, whose env worker is between lives until ``born`` is called."""

    def __init__(self):
        self.progress = SimpleNamespace(iteration=5)
        self.recovery = SimpleNamespace(recovering=False)
        self.group = SimpleNamespace(processes=[None], workers=[None])
        self.workers = SimpleNamespace(groups={"env": self.group})

    def born(self, pid: int) -> None:
        self.group.processes = [SimpleNamespace(pid=pid)]


@pytest.mark.integration  # it signals a real process
def test_an_injection_whose_target_is_between_lives_fires_once_it_is_back_and_a_missed_one_says_why():
    """CI once saw 3 of 4 scheduled faults injected: the fourth found its worker being replaced and was
    dropped. It now waits for the worker; one the run outlives is reported with its reason."""
    trainer = _Between()
    sleeper = subprocess.Popen(["sleep", "60"])
    monkey = ChaosMonkey(trainer, [Injection(2, 0.0, "env", 0, "kill"), Injection(9, 0.0, "env", 0, "kill")],
                         poll_s=0.01, retry_s=0.05)
    monkey.start()
    deadline = time.monotonic() + 30  # the first try imports Ray
    while monkey.missed.get(0) != "no env process was running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert monkey.fired == [] and monkey.missed == {0: "no env process was running"}
    trainer.born(sleeper.pid)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    monkey.stop()  # the run ends before iteration 9
    assert [shot.pid for shot in monkey.fired] == [sleeper.pid]
    result = report(monkey.fired, monkey.schedule, {"count": 0, "events": []}, monkey.missed)
    assert result["injected"] == 1 and result["missed"][0]["iteration"] == 9
    assert "not injected: env kill due at iteration 9: the run ended before its iteration" in markdown(result)


def test_the_chaos_schedule_is_seeded_spread_and_hits_every_target():
    a, b = draw_schedule(3, 12, 50), draw_schedule(3, 12, 50)
    assert a == b and a != draw_schedule(4, 12, 50)
    assert all(2 <= i.iteration <= 40 for i in a)
    assert [i.iteration for i in a] == sorted(i.iteration for i in a)
    assert {i.target for i in a} == {"env", "rollout", "actor"}
    assert {i.how for i in a} <= {"kill", "stop"}


class HangsWhileStarting(Worker):
    """A worker whose constructor never returns: always, or (``marker``) once that file exists,
    so that the first start succeeds and the replacement hangs."""

    def __init__(self, marker: str = "", **kwargs):
        super().__init__(**kwargs)
        if not marker or os.path.exists(marker):
            time.sleep(3600)


@pytest.mark.parametrize("start", ["first", "replacement"])
def test_a_worker_whose_constructor_hangs_is_reported_hung_within_its_start_deadline(ray_cluster, tmp_path, start):
    from embodied.config import PlacementConfig
    from scheduler.placement import make_plan
    from scheduler.runtime.cluster import cluster_devices

    plan = make_plan(PlacementConfig(env_workers=1, env="0", rollout="0", actor="1"), cluster_devices(), num_envs=1)
    marker = tmp_path / "hang"
    group = None
    if start == "replacement":
        group = WorkerGroup(HangsWhileStarting, "env", plan, marker=str(marker), start_deadline_s=120)
        group.start_deadline_s = 3
        marker.touch()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailure) as failure:
            if group is None:
                WorkerGroup(HangsWhileStarting, "env", plan, start_deadline_s=3)
            else:
                group.replace(0)
        elapsed = time.monotonic() - started
    finally:
        if group is not None:
            group.shutdown()
    assert 3 <= elapsed < 15, elapsed
    (fault,) = failure.value.faults  # the hung rank, named as the watchdog names a hang: the runner replaces it
    assert (fault.group, fault.rank, fault.kind) == ("env", 0, "hung")
    assert "env worker rank 0 hung during env start-up" in str(failure.value)
    assert "start-up deadline of 3 s" in str(failure.value) and "runner.first_call_deadline_s" in str(failure.value)


class Blocked(Worker):
    """A worker whose call waits on a channel item that never comes (a peer that hangs)."""

    def pid(self) -> int:
        return os.getpid()

    def wait_for_peer(self, channel: Channel) -> None:
        with self.waiting():
            channel.get(("never", self.rank))


def test_one_stopped_worker_is_named_hung_and_its_peers_blocked_on_it_are_kept(ray_cluster):
    """Both ranks wait on the channel and one is SIGSTOPped: only it is silent (the other answers on
    its control thread while its call blocks) and named; closing the channel ends the other's call."""
    from embodied.config import PlacementConfig
    from scheduler.placement import make_plan
    from scheduler.runtime.cluster import cluster_devices

    plan = make_plan(PlacementConfig(env_workers=2, env="0-1", rollout="0", actor="1"), cluster_devices(), num_envs=2)
    watchdog = Watchdog(Deadlines(floor_s=1, factor=1, first_s=1, fixed_s=2), probe_every_s=1, ping_timeout_s=3)
    group = watchdog.watch(WorkerGroup(Blocked, "env", plan, start_deadline_s=120))
    channel = Channel()
    try:
        pids = group.call("pid")
        refs = group.call_async("wait_for_peer", channel)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(WorkerFailure) as failure:
            watchdog.get(refs, "wait_for_peer")
        assert [(f.group, f.rank, f.kind) for f in failure.value.faults] == [("env", 1, "hung")], failure.value
        assert "does not answer a ping" in failure.value.faults[0].detail
        group.kill(1)
        channel.close()
        assert watchdog.settle(10) == []  # the survivor's call ended with the channel: not hung
    finally:
        group.shutdown()


class Works(Worker):
    """A worker busy in its own work: computing (``spin``) or stuck without using a core (``sleep``)."""

    def spin(self, seconds: float) -> float:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return seconds

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_worker_past_its_deadline_that_still_computes_is_waited_for_one_that_does_not_is_hung(ray_cluster):
    """A loaded machine or a call whose cost jumped (SAC's first real update after no-op ones) is slow,
    not hung: its CPU time grows, and the watchdog waits on (up to the start-up deadline)."""
    from embodied.config import PlacementConfig
    from scheduler.placement import make_plan
    from scheduler.runtime.cluster import cluster_devices

    plan = make_plan(PlacementConfig(env_workers=1, env="0", rollout="0", actor="1"), cluster_devices(), num_envs=1)
    deadlines = Deadlines(floor_s=2, factor=1, first_s=60)
    deadlines.record("spin", 0.1)
    deadlines.record("sleep", 0.1)
    watchdog = Watchdog(deadlines, probe_every_s=1, ping_timeout_s=3)
    group = watchdog.watch(WorkerGroup(Works, "env", plan, start_deadline_s=120))
    try:
        assert watchdog.get(group.call_async("spin", 9.0), "spin") == [9.0]  # 4.5 x its deadline of 2 s
        with pytest.raises(WorkerFailure) as failure:
            watchdog.get(group.call_async("sleep", 600.0), "sleep")
        assert [(f.rank, f.kind) for f in failure.value.faults] == [(0, "hung")]
        assert "busy in its own work" in failure.value.faults[0].detail
    finally:
        group.shutdown()


def _train_with(tmp_path, *injections: Injection, overrides: tuple[str, ...] = ()):
    cfg = small_config(f"runner.run_dir={tmp_path}", *FAULTY, *overrides)
    trainer = Trainer(cfg, tmp_path)
    monkey = ChaosMonkey(trainer, list(injections))
    monkey.start()
    try:
        summary = trainer.train()
    finally:
        monkey.stop()
        trainer.close()
    return trainer, summary, monkey


# embodied chaos's test below stops an env worker and kills the others in one run (the suite's
# time); each fault alone, with its own checks, is a slow test
@pytest.mark.parametrize("target,how,kind", [("env", "kill", "dead"), ("rollout", "kill", "dead"),
                                             ("actor", "kill", "dead"), ("env", "stop", "hung")])
@pytest.mark.slow
def test_a_run_survives_a_worker_killed_or_stopped_mid_run(ray_cluster, tmp_path, target, how, kind):
    trainer, summary, monkey = _train_with(tmp_path, Injection(3, 0.3, target, 1, how))
    assert len(monkey.fired) == 1, "the fault was not injected"
    faults = summary["faults"]
    mine = [e for e in faults["events"] if e["pid"] == monkey.fired[0].worker_pid]
    assert mine and mine[0]["group"] == target and mine[0]["kind"] == kind, faults
    # the run completed every iteration and its final evaluation, on workers that are not the faulty one
    assert trainer.progress.iteration == trainer.total_iterations == 6
    assert summary["training"]["env_steps"] == 240 and summary["episodes"] == 4
    assert monkey.fired[0].worker_pid not in trainer.workers.process_ids(target)
    if target == "actor":  # restored from the checkpoint of iteration 2 (checkpoint_every=2): at most 2 lost
        assert mine[0]["action"].startswith("actor group restored from ckpt_") and mine[0]["iterations_lost"] <= 2
    else:
        assert mine[0]["action"] == "replaced" and mine[0]["iterations_lost"] == 0
    if how == "stop":  # found within its deadline (its text says which) plus the pings that tell a hang
        deadline = float(re.search(r"deadline of (\d+) s", mine[0]["detail"]).group(1))
        assert deadline < 60  # the call's measured duration set it, not the 900 s start-up deadline
        assert mine[0]["detected_at"] - monkey.fired[0].unix_time < deadline + 30
    assert report(monkey.fired, [], faults)["detected"] == 1


@pytest.mark.slow  # two runs (the suite's time); the chaos test below covers recovery in the default run
def test_grpo_redoes_a_broken_iteration_exactly_so_the_run_ends_as_one_without_faults(ray_cluster, tmp_path):
    """GRPO resets every iteration from seeded states and draws the iteration's own rollout noise:
    the iteration a killed env worker broke is redone as it would have run, so the final weights
    equal those of a run without the fault, bit for bit."""
    grpo = ("algorithm=grpo", "algorithm.group_size=2", "env.max_episode_steps=10", "algorithm.rollout_steps=10",
            "algorithm.filter_uniform_groups=false")
    faulty, _, monkey = _train_with(tmp_path / "faulty", Injection(2, 0.2, "env", 0, "kill"), overrides=grpo)
    clean, _, _ = _train_with(tmp_path / "clean", overrides=grpo)
    assert len(monkey.fired) == 1
    a = load_checkpoint(tmp_path / "faulty")["actor"]["policy"]
    b = load_checkpoint(tmp_path / "clean")["actor"]["policy"]
    assert all((a[k] == b[k]).all() for k in a)


def test_embodied_chaos_reports_the_faults_it_injected_and_the_run_survived(tmp_path):
    """Four faults, one per target: an env worker stopped (a hang), the rollout and actor workers
    killed, and a simulator process under an env worker killed (the env worker raises). Each is
    detected as what it is, and the run completes and evaluates."""
    run_dir = tmp_path / "run"
    args = [*SMALL_OVERRIDES, *FAULTY, "runner.total_env_steps=480", "env.num_procs=1", f"runner.run_dir={run_dir}",
            "ray.num_cpus=2"]
    proc = run_cli("chaos", *args, "--faults", "4", "--chaos-seed", "1", "--targets", "env,rollout,actor,simulator",
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chaos = json.loads((run_dir / "chaos.json").read_text())
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert chaos["injected"] == 4 and chaos["detected"] == 4, chaos
    found = {(r["target"], r["how"]): r["detected_as"] for r in chaos["injections"]}
    assert found == {("env", "stop"): "hung", ("rollout", "kill"): "dead", ("actor", "kill"): "dead",
                     ("simulator", "kill"): "crashed"}, chaos
    assert evaluation["faults"]["count"] >= 4 and len(evaluation["rows"]) == 4
    assert evaluation["training"]["env_steps"] == 480
    assert "detected and survived" in (run_dir / "chaos.md").read_text()


@pytest.mark.slow  # 40 s; the other strategies' recovery runs in the test above
def test_a_lost_rollout_worker_under_broadcast_weight_sync_restarts_the_broadcast_group(tmp_path):
    """A torch.distributed broadcast group cannot take a new member (``WeightSync.fixed_membership``):
    killing the rollout worker restarts it and the actor, which keeps its state, and the run goes on."""
    run_dir = tmp_path / "run"
    args = [*SMALL_OVERRIDES, *FAULTY, "placement.weight_sync=broadcast", f"runner.run_dir={run_dir}",
            "ray.num_cpus=2"]
    proc = run_cli("chaos", *args, "--faults", "1", "--targets", "rollout", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chaos = json.loads((run_dir / "chaos.json").read_text())
    assert chaos["injected"] == 1 and chaos["detected"] == 1, chaos
    assert json.loads((run_dir / "eval.json").read_text())["training"]["env_steps"] == 240


def test_beyond_the_restart_budget_the_run_stops_with_exit_4_a_fresh_checkpoint_and_the_message(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL_OVERRIDES, *FAULTY, "runner.checkpoint_every=1000", "runner.max_worker_restarts=0",
            f"runner.run_dir={run_dir}", "ray.num_cpus=2"]
    proc = run_cli("chaos", *args, "--faults", "1", "--targets", "env", timeout=600)
    assert proc.returncode == 4, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("error: "):]
    assert "env worker rank" in message and "runner.max_worker_restarts=0" in message
    assert f"embodied train resume={run_dir}" in message
    # no periodic checkpoint was due (checkpoint_every=1000): the one there was written on the way out
    state = load_checkpoint(run_dir)
    assert 2 <= state["progress"]["iteration"] < 6
    assert "A checkpoint was written now" in message
