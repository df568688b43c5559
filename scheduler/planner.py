"""Search over execution plans with the cost model: the fastest feasible one, and the table.

Candidates for ``D`` devices (see :class:`scheduler.cost_model.Candidate`):

- ``colocated``: every group on all ``D`` devices, taking turns (one stage), with and
  without offloading the actor between phases;
- ``hybrid``: env workers on ``De`` devices, rollout workers on the other ``D - De``, the
  actor time-sharing the rollout devices (with and without offload), ``S`` micro-batches;
- ``disaggregated``: env, rollout and actor each on devices of their own, ``S`` micro-batches.

``S`` ranges over ``stages`` (powers of two by default), and each plan's actor trains on 1, 2,
4, ... or all of its devices as data-parallel ranks. The best plan is the feasible one with
the smallest predicted iteration time; ties go to the simpler plan (fewer stages, no
offload, fewer actor ranks), in the order candidates are listed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.cost_model import (
    ONE_NODE,
    Candidate,
    Network,
    Prediction,
    Profile,
    Workload,
    predict,
)

DEFAULT_STAGES = (1, 2, 4, 8)


def candidates(devices: int, stages: tuple[int, ...] = DEFAULT_STAGES, offload: bool = True) -> list[Candidate]:
    """Every plan on ``devices`` devices, simplest first; ``offload=False`` leaves out the plans
    that offload (CPU slots: they share one host memory, there is nothing to free)."""
    switches = (False, True) if offload else (False,)
    out = [Candidate("colocated", devices, devices, devices, 1, o) for o in switches]
    for s in stages:
        for env in range(1, devices):
            out += [Candidate("hybrid", env, devices - env, devices - env, s, o) for o in switches]
        for env in range(1, devices - 1):
            for rollout in range(1, devices - env):
                out.append(Candidate("disaggregated", env, rollout, devices - env - rollout, s))
    return [replace(c, actor_ranks=r) for c in out for r in actor_rank_counts(c.actor_devices)]


def actor_rank_counts(devices: int) -> list[int]:
    """Data-parallel degrees tried on ``devices`` actor devices: powers of two, and all of them."""
    return sorted({2**k for k in range(devices.bit_length()) if 2**k <= devices} | {devices})


@dataclass
class PlanChoice:
    best: Prediction | None  # None: no plan fits
    table: list[Prediction]  # every candidate, fastest feasible first, infeasible last

    def markdown(self, limit: int | None = None) -> str:
        rows = ["| plan | predicted iteration (s) | generate (s) | train (s) | switch (s) | peak MiB | note |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for pred in self.table[:limit]:
            mark = "**best**" if pred is self.best else pred.infeasible
            rows.append(f"| {pred.candidate.name()} | {pred.iteration_s:.3f} | {pred.generate_s:.3f} | "
                        f"{pred.train_s:.3f} | {pred.switch_s:.3f} | {max(pred.memory.values(), default=0):.0f} | "
                        f"{mark} |")
        return "\n".join(rows)


def plan(profile: Profile, workload: Workload, devices: int, stages: tuple[int, ...] = DEFAULT_STAGES,
         offload: bool = True, network: Network = ONE_NODE) -> PlanChoice:
    """The fastest feasible plan on ``devices`` devices (on nodes shaped as ``network``), with
    the table of all candidates."""
    predictions = [predict(c, profile, workload, network) for c in candidates(devices, stages, offload)]
    order = sorted(range(len(predictions)),
                   key=lambda i: (not predictions[i].feasible, predictions[i].iteration_s, i))
    table = [predictions[i] for i in order]
    best = table[0] if table and table[0].feasible else None
    return PlanChoice(best, table)
