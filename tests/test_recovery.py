"""The recovery loop the trainer and `embodied eval` share (embodied/recovery.py): pure logic
over a workers object that records what it was asked to replace. The real replacement is tested
with Ray in tests/test_faults.py and by `embodied chaos`."""

from types import SimpleNamespace

import pytest

from embodied.config import RunnerConfig
from embodied.recovery import FaultLog, Recovery
from scheduler.runtime.faults import RestartBudgetExceeded, WorkerFailure, WorkerFault


class ReplacingWorkers:
    """``recover`` replaces what a failure names; it fails itself the first ``fail_first`` times."""

    def __init__(self, fail_first: int = 0):
        self.layout = SimpleNamespace(envs_per_worker=4)
        self.replaced: list[tuple[str, int]] = []
        self.fail_first = fail_first

    def recover(self, failure: WorkerFailure) -> list[WorkerFault]:
        self.replaced += [(f.group, f.rank) for f in failure.faults]
        if self.fail_first:
            self.fail_first -= 1
            raise _failure("actor", "actor.restart")
        return list(failure.faults)


def _failure(group: str, call: str = "rollout") -> WorkerFailure:
    return WorkerFailure(call, [WorkerFault(group, 0, "dead", call, "exit code -9", pid=123)], "died")


def _recovery(workers, events: list, restarts: int = 3) -> Recovery:
    return Recovery(workers, FaultLog(RunnerConfig(max_worker_restarts=restarts)), note=events.append,
                    restore_actor=lambda: events.append("restore") or (2, "restored"),
                    now=lambda: (1.5, 7), recovered=lambda: events.append("recovered"))


def _failing(times: int, group: str):
    calls = {"n": 0}

    def work():
        calls["n"] += 1
        if calls["n"] <= times:
            raise _failure(group)
        return "result"
    return work


def test_work_a_fault_broke_is_reported_undone_and_the_worker_replaced():
    workers, events = ReplacingWorkers(), []
    recovery = _recovery(workers, events)
    work = _failing(1, "env")
    assert recovery.guarded(work) == (False, None)
    assert recovery.guarded(work) == (True, "result")  # the caller redoes it
    assert workers.replaced == [("env", 0)]
    assert "restore" not in events and events.count("recovered") == 1  # an env worker: the actor keeps its state
    (record,) = recovery.faults.records
    assert (record.group, record.minute, record.iteration, record.episodes_failed, record.iterations_lost) \
        == ("env", 1.5, 7, 4, 0)


def test_a_lost_actor_is_restored_through_the_hook_and_its_loss_counted_once():
    workers, events = ReplacingWorkers(), []
    recovery = _recovery(workers, events)
    recovery.guarded(_failing(1, "actor"))
    assert events.index("restore") < events.index("recovered")
    assert [r.iterations_lost for r in recovery.faults.records] == [2]
    assert recovery.faults.records[0].action == "restored"


def test_a_failure_met_while_recovering_is_recovered_from_too():
    workers, events = ReplacingWorkers(fail_first=1), []
    recovery = _recovery(workers, events)
    assert recovery.guarded(_failing(1, "rollout")) == (False, None)
    assert workers.replaced == [("rollout", 0), ("actor", 0)]
    assert not recovery.recovering


def test_beyond_the_budget_give_up_runs_then_the_run_stops():
    workers, events = ReplacingWorkers(), []
    recovery = _recovery(workers, events, restarts=1)
    given_up = []
    recovery.give_up = lambda exceeded, failure: given_up.append(failure.call)
    work = _failing(5, "env")
    assert recovery.guarded(work) == (False, None)
    with pytest.raises(RestartBudgetExceeded):
        recovery.guarded(work)
    assert given_up == ["rollout"] and len(recovery.faults.records) == 1


class SettlingWorkers(ReplacingWorkers):
    """``recover`` replaces what a failure names, plus ``stuck``: survivors whose calls did not end."""

    def __init__(self, stuck: list[WorkerFault]):
        super().__init__()
        self.stuck = stuck

    def recover(self, failure: WorkerFailure) -> list[WorkerFault]:
        return super().recover(failure) + self.stuck


def test_one_hung_worker_charges_the_budget_once_and_fails_only_its_own_episodes():
    """Issue 57: the watchdog names the stopped env worker alone (tests/test_faults.py), so one restart
    is spent and only its envs' episodes end as failed; with 2 env workers, the other's are not."""
    workers, events = ReplacingWorkers(), []
    recovery = _recovery(workers, events)
    hung = WorkerFault("env", 1, "hung", "rollout", "no answer within its deadline; it does not answer a ping", 7)

    def work():
        raise WorkerFailure("rollout", [hung], "deadline")
    assert recovery.guarded(work) == (False, None)
    assert workers.replaced == [("env", 1)]
    assert {group: len(times) for group, times in recovery.faults.budget.restarts.items()} == {"env": 1}
    (record,) = recovery.faults.records
    assert (record.rank, record.kind, record.episodes_failed) == (1, "hung", 4)
    assert recovery.faults.summary()["episodes_failed"] == 4  # one worker's envs (envs_per_worker=4), not 8


def test_a_survivor_still_busy_after_the_channel_closed_is_recorded_but_not_charged():
    stuck = WorkerFault("rollout", 0, "hung", "rollout", "still busy 30 s after the call was aborted", 9)
    workers, events = SettlingWorkers([stuck]), []
    recovery = _recovery(workers, events)
    recovery.guarded(_failing(1, "env"))
    assert {group: len(times) for group, times in recovery.faults.budget.restarts.items()} == {"env": 1}
    assert [(r.group, r.episodes_failed) for r in recovery.faults.records] == [("env", 4), ("rollout", 0)]
