"""``placement.mode: auto``: profile the stages (or read the cached profile), plan, apply the plan.

:func:`auto_placement` returns the placement config of the fastest feasible plan the
planner finds for this cluster's devices, with the table of candidates and the predicted
iteration time; the runner logs the table, runs the plan and, at the end, reports the
prediction against the measured iteration time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from envs.common import UserError
from scheduler.cost_model import Profile, Workload
from scheduler.placement import to_placement
from scheduler.planner import PlanChoice, plan
from scheduler.profiler import StageRunners, cached_profile
from scheduler.runtime.data_parallel import resolve_strategy


class PlannedAlgorithm(Protocol):
    """What the planner needs of the run's algorithm (``embodied.algorithms.base.Algorithm``)."""

    group_size: int
    max_actor_ranks: int | None


@dataclass
class AutoPlan:
    placement: object  # the PlacementConfig to run
    choice: PlanChoice
    profile: Profile
    profile_path: Path
    profiled_now: bool
    profile_seconds: float  # spent profiling in this run (0 when the cache had it)

    @property
    def predicted_s(self) -> float:
        return self.choice.best.iteration_s


def profile_sizes(num_envs: int) -> list[int]:
    """Batch sizes to measure: a micro-batch of a quarter, half and all of the envs."""
    return sorted({max(1, num_envs // 4), max(1, num_envs // 2), num_envs})


def workload_of(cfg, profile: Profile, algorithm: PlannedAlgorithm) -> Workload:
    """An iteration of ``cfg``: its envs, decisions per env, the envs its ``algorithm`` needs in one
    micro-batch (``group_size``: GRPO's groups; 1: any split) and the actor ranks it can train on,
    and whether the rollout overlaps the update (``runner.collection=async``)."""
    placement = cfg.placement
    sharded = resolve_strategy(placement.data_parallel, profile.parameters, placement.fsdp_from_parameters) == "fsdp"
    return Workload(cfg.env.num_envs, cfg.algorithm.rollout_steps or profile.episode_steps, algorithm.group_size,
                    sharded, overlap=cfg.runner.collection == "async", sync_every=cfg.runner.weight_sync_every,
                    max_actor_ranks=algorithm.max_actor_ranks)


def auto_placement(cfg, devices: int, device_kind: str, runners: StageRunners, log=print) -> AutoPlan:
    """Profile ``cfg`` on this machine (cached; ``runners`` run the stages), plan for ``devices``
    devices, and choose. ``device_kind`` names the devices in errors; the profile says whether
    offloading helps."""
    started = time.perf_counter()
    profile, path, measured = cached_profile(cfg, profile_sizes(cfg.env.num_envs), devices,
                                             Path(cfg.placement.profile_dir), runners, log)
    seconds = time.perf_counter() - started
    workload = workload_of(cfg, profile, runners.algorithm(cfg.algorithm))
    choice = plan(profile, workload, devices, offload=profile.device_kind == "gpu")
    if choice.best is None:
        raise UserError(f"placement.mode=auto found no plan that fits {devices} {device_kind} device(s): "
                        f"{choice.table[0].infeasible}. Give the run more devices, fewer envs or a smaller "
                        "policy.")
    return AutoPlan(to_placement(choice.best.candidate, cfg.placement), choice, profile, path, measured,
                    seconds if measured else 0.0)
