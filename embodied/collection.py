"""How the trainer gets each iteration's rollout: in lockstep with the updates, or asynchronously
(``runner.collection``).

- :class:`LockstepCollector` (``sync``, the default): sync the actor's weights to the rollout
  workers, then roll out; the update waits for the rollout and the rollout for the update, so a
  batch is always collected by the weights that train on it.
- :class:`AsyncCollector` (``async``, off-policy algorithms): once iteration ``i``'s rollout is in,
  the next one starts at once, with the weights synced last, and runs while the actor updates on
  iteration ``i``'s; the weights are synced every ``runner.weight_sync_every`` iterations. Each
  batch's ``policy_lag`` says how many updates behind its behaviour weights were.

Both give the trainer a :class:`Collected` per iteration and keep the env workers free when the
trainer needs them for something else (:meth:`settle`: a validation, a reset of the training envs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied.runner import RolloutCall, Workers
from envs.common import UserError


@dataclass
class Collected:
    """One iteration's rollout: the finished episodes' rows, the trajectories' object refs (for the
    actor), stage times, and ``policy_lag``: actor updates made since its weights were synced."""

    episodes: list[dict]
    trajectories: list
    times: dict[str, float] = field(default_factory=dict)
    policy_lag: int = 0


class LockstepCollector:
    """Weight sync, then the rollout: the batch of iteration ``i`` is the weights of update ``i``'s."""

    def __init__(self, workers: Workers):
        self.workers = workers

    def collect(self, iteration: int) -> Collected:
        sync = self.workers.prepare_generation()
        episodes, trajectories, times = self.workers.rollout_steps(self.workers.steps_per_rollout, iteration)
        return Collected(episodes, trajectories, {**sync, **times})

    def settle(self) -> None:
        """Nothing in flight between iterations."""

    def forget(self) -> None:
        """Nothing in flight to drop after a fault."""


class AsyncCollector:
    """Rollout ``i + 1`` runs while the actor trains on rollout ``i`` (module docstring)."""

    def __init__(self, workers: Workers, sync_every: int):
        if workers.plan.offload:
            raise UserError("runner.collection=async runs the rollout and the update at once, but this placement "
                            "offloads the actor while the envs run (placement.offload=auto on shared GPUs). Set "
                            "placement.offload=never, or give the actor devices of its own (placement.mode=hybrid).")
        self.workers = workers
        self.sync_every = sync_every
        self.in_flight: tuple[RolloutCall, int] | None = None  # a started rollout, and its weights' version
        self.ready: tuple[tuple, int] | None = None  # a rollout that finished early (settle), and its version
        self.synced_version = -1  # the actor's update count at the last weight sync

    def collect(self, iteration: int) -> Collected:
        """Iteration ``iteration``'s rollout (``iteration`` updates made so far); starts the next one."""
        sync: dict[str, float] = {}
        if self.ready is None and self.in_flight is None:
            sync = self._sync(iteration)
            self._start(iteration)
        result, version = self.ready or self._finish()
        self.ready = None
        if iteration - self.synced_version >= self.sync_every:
            sync = self._sync(iteration)
        self._start(iteration + 1)
        episodes, trajectories, times = result
        return Collected(episodes, trajectories, {**sync, **times}, policy_lag=iteration - version)

    def settle(self) -> None:
        """Let the rollout in flight finish and keep it for the next :meth:`collect`: the env workers are
        then free for a validation or a reset."""
        if self.in_flight is not None:
            self.ready = self._finish()

    def forget(self) -> None:
        """A fault broke the calls in flight: drop them (the trainer resets the envs)."""
        self.in_flight, self.ready = None, None

    def _sync(self, iteration: int) -> dict[str, float]:
        self.synced_version = iteration
        return self.workers.prepare_generation()

    def _start(self, iteration: int) -> None:
        self.in_flight = (self.workers.start_rollout(self.workers.steps_per_rollout, iteration), self.synced_version)

    def _finish(self) -> tuple[tuple, int]:
        call, version = self.in_flight
        self.in_flight = None
        return self.workers.finish_rollout(call), version


def make_collector(workers: Workers, collection: str, sync_every: int) -> LockstepCollector | AsyncCollector:
    """``runner.collection``: ``sync`` or ``async`` (checked with the config, embodied/checks.py)."""
    return AsyncCollector(workers, sync_every) if collection == "async" else LockstepCollector(workers)
