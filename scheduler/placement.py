"""Where each worker group runs: a Plan resolved from ``placement`` config.

Devices are GPUs on a cluster with GPUs and CPU slots otherwise, numbered across the
whole cluster node by node (the head node first): with two 8-GPU nodes, devices 0-7
are the head's and 8-15 the other's. A group's device range (``"0-1"``, ``"0,2"``,
``"3"``) lists the devices its ranks are spread over: rank ``i`` lands on device
``range[i % len(range)]``.

Modes say which groups may share a device:

- ``colocated``: env and rollout workers share devices, and the actor shares them
  too; groups take turns (context switching), so env and rollout never overlap
  (``pipeline_stages`` must be 1).
- ``disaggregated``: every group on its own devices; env and rollout overlap on
  micro-batches (``pipeline_stages`` > 1).
- ``hybrid``: env and rollout on separate devices (pipelined) and the actor
  time-sharing theirs: RLinf's usual plan for embodied RL.
"""

from __future__ import annotations

from dataclasses import replace

from envs.common import UserError
from scheduler.cost_model import Candidate
from scheduler.runtime.plan import GROUPS, ClusterDevices, GroupPlacement, Plan

MODES = ("colocated", "disaggregated", "hybrid")
OFFLOAD = ("auto", "always", "never")
WEIGHT_SYNC = ("auto", "shared_memory", "object_store", "broadcast")


def parse_devices(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    devices: list[int] = []
    try:
        for part in str(spec).split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                if hi < lo:
                    raise ValueError
                devices.extend(range(lo, hi + 1))
            else:
                devices.append(int(part))
    except ValueError:
        raise UserError(f"Bad device range {spec!r} in placement: write it like \"0-3\", \"0,2\" or \"1\".") from None
    return devices


def actor_update_threads(cfg) -> int:
    """The actor's intra-op threads while it updates (CPU), for a run's ``cfg`` (a ``TrainConfig``):
    ``placement.actor_threads`` when the other groups wait for it (``runner.collection=sync``),
    ``placement.torch_threads`` when the envs step meanwhile (``async``: on a small CPU, more threads
    would only take the simulators' cores). The profiler times the update on as many."""
    return cfg.placement.actor_threads if cfg.runner.collection == "sync" else cfg.placement.torch_threads


def make_plan(placement_cfg, cluster: ClusterDevices, num_envs: int) -> Plan:
    """Validate ``placement_cfg`` against the cluster's devices and build the Plan."""
    cfg = placement_cfg
    if cfg.mode not in MODES:
        raise UserError(f"placement.mode={cfg.mode!r} is not a placement mode: use one of {', '.join(MODES)}, "
                        "or auto.")
    counts = {"env": cfg.env_workers, "rollout": cfg.rollout_workers, "actor": cfg.actor_workers}
    groups = {name: _group(name, getattr(cfg, name), counts[name], cluster) for name in GROUPS}
    _check_actor_ranks(cfg, groups["actor"], num_envs)
    if cfg.pipeline_stages < 1:
        raise UserError(f"placement.pipeline_stages must be at least 1 (got {cfg.pipeline_stages}).")
    per_batch = counts["env"] * cfg.pipeline_stages
    if num_envs % per_batch != 0:
        raise UserError(
            f"env.num_envs={num_envs} does not split evenly into placement.env_workers={counts['env']} x "
            f"placement.pipeline_stages={cfg.pipeline_stages} micro-batches: make num_envs a multiple of "
            f"{per_batch}, or change the worker or stage count."
        )
    _check_mode(cfg, {name: set(g.devices) for name, g in groups.items()})
    plan = Plan(cfg.mode, groups, cluster, cfg.pipeline_stages, offload=_resolve_offload(cfg.offload, cluster),
                pin_cpus=cfg.pin_cpus and cluster.kind == "cpu")
    return replace(plan, weight_sync=_resolve_weight_sync(cfg.weight_sync, plan))


def check_placement(placement_cfg, num_envs: int) -> None:
    """Every check of :func:`make_plan` that needs no cluster (modes, overlaps, counts, stages),
    so that a bad placement fails before Ray starts. ``mode: auto`` is checked once planned."""
    if placement_cfg.mode == "auto":
        return
    highest = max(max(parse_devices(getattr(placement_cfg, name))) for name in GROUPS)
    make_plan(placement_cfg, ClusterDevices.single_node("cpu", max(highest, 0) + 1), num_envs)


def _resolve_offload(choice: str, cluster: ClusterDevices) -> bool:
    if choice not in OFFLOAD:
        raise UserError(f"placement.offload={choice!r}: use one of {', '.join(OFFLOAD)}.")
    return choice == "always" or (choice == "auto" and cluster.kind == "gpu")


def _resolve_weight_sync(choice: str, plan: Plan) -> str:
    if choice not in WEIGHT_SYNC:
        raise UserError(f"placement.weight_sync={choice!r}: use one of {', '.join(WEIGHT_SYNC)}.")
    if choice == "auto":
        return "shared_memory" if plan.same_node("rollout", "actor") else "object_store"
    if choice == "shared_memory" and not plan.same_node("rollout", "actor"):
        raise UserError("placement.weight_sync=shared_memory needs the actor and every rollout worker on "
                        "one node; these span several. Use weight_sync=object_store (or auto).")
    if choice == "broadcast" and plan.groups["actor"].num_workers > 1:
        raise UserError(
            f"placement.weight_sync=broadcast with placement.actor_workers={plan.groups['actor'].num_workers}: "
            "the broadcast puts actor rank 0 and the rollout workers in one torch.distributed group, and "
            "the actor ranks are in their own data-parallel group already; a process joins one such group. "
            "Use weight_sync=shared_memory (one node) or object_store (or auto), or actor_workers=1.")
    if choice == "broadcast" and plan.offload and plan.shares_device("rollout", "actor"):
        raise UserError("placement.weight_sync=broadcast needs actor and rollout workers on their devices at "
                        "the same time, but they share a device and take turns (offload is on). Use "
                        "weight_sync=shared_memory (or auto), or put them on separate devices.")
    return choice


def _check_actor_ranks(cfg, actor: GroupPlacement, num_envs: int) -> None:
    """Data-parallel actor ranks: a device each, and an equal share of the batch each."""
    if actor.num_workers > len(set(actor.devices)):
        raise UserError(
            f"placement.actor_workers={actor.num_workers} actor ranks, but placement.actor={cfg.actor!r} names "
            f"{len(set(actor.devices))} device(s): data-parallel ranks train on a device each (NCCL cannot put two "
            f"on one GPU). Give placement.actor at least {actor.num_workers} devices (e.g. "
            f"\"0-{actor.num_workers - 1}\"), or lower placement.actor_workers.")
    if num_envs % actor.num_workers:
        raise UserError(
            f"env.num_envs={num_envs} does not split evenly over placement.actor_workers={actor.num_workers} "
            f"actor ranks (each trains on an equal share of the envs): make num_envs a multiple of "
            f"{actor.num_workers}, or change the actor rank count.")


def _group(name: str, spec: str, count: int, cluster: ClusterDevices) -> GroupPlacement:
    if count < 1:
        raise UserError(f"placement.{name}_workers must be at least 1 (got {count}).")
    devices = parse_devices(spec)
    available = len(cluster.devices)
    bad = [d for d in devices if d >= available or d < 0]
    if bad:
        raise UserError(
            f"placement.{name}={spec!r} names {cluster.kind} device(s) {bad}, but the cluster has "
            f"{available} {cluster.kind} device(s) (0-{available - 1}). Change placement.{name} or give "
            f"Ray more devices (ray.num_cpus / ray.num_gpus, or more nodes)."
        )
    return GroupPlacement(name, count, devices, cluster.kind)


def _check_mode(cfg, ranges: dict[str, set[int]]) -> None:
    """Reject device overlaps the mode forbids, and sharing the mode needs but lacks."""
    env_rollout = ranges["env"] & ranges["rollout"]
    if cfg.mode == "colocated":
        if not env_rollout:
            raise UserError(
                f"placement.mode=colocated, but env ({cfg.env}) and rollout ({cfg.rollout}) share no "
                f"device. Colocated groups time-share devices: give them overlapping ranges, or use "
                f"mode=hybrid (env and rollout apart, actor sharing) or mode=disaggregated."
            )
        if cfg.pipeline_stages != 1:
            raise UserError(
                f"placement.pipeline_stages={cfg.pipeline_stages} with mode=colocated: colocated env and "
                f"rollout workers take turns on a device, so micro-batches cannot overlap. Set "
                f"pipeline_stages=1, or put env and rollout on separate devices with mode=hybrid or "
                f"mode=disaggregated."
            )
        return
    forbidden = [("env", "rollout")]
    if cfg.mode == "disaggregated":
        forbidden += [("env", "actor"), ("rollout", "actor")]
    for a, b in forbidden:
        overlap = ranges[a] & ranges[b]
        if overlap:
            raise UserError(
                f"placement.mode={cfg.mode} keeps {a} and {b} on separate devices, but "
                f"placement.{a}={getattr(cfg, a)!r} and placement.{b}={getattr(cfg, b)!r} both use "
                f"device(s) {sorted(overlap)}. Give them disjoint ranges, or use mode=colocated"
                + (" (or hybrid, where the actor shares devices)." if cfg.mode == "disaggregated" else ".")
            )
    if cfg.mode == "hybrid" and not ranges["actor"] & (ranges["env"] | ranges["rollout"]):
        raise UserError(
            f"placement.mode=hybrid time-shares the actor's devices with env or rollout workers, but "
            f"placement.actor={cfg.actor!r} shares none of theirs: overlap it with them, or use "
            f"mode=disaggregated."
        )


def _span(devices: range) -> str:
    return f"{devices.start}-{devices.stop - 1}" if len(devices) > 1 else str(devices.start)


def to_placement(c: Candidate, base) -> object:
    """The placement config that runs candidate ``c`` (``base`` gives the other fields)."""
    sets = c.device_sets()
    return replace(
        base, mode=c.mode, env=_span(sets["env"]), rollout=_span(sets["rollout"]), actor=_span(sets["actor"]),
        env_workers=c.env_devices, rollout_workers=c.rollout_devices, actor_workers=c.actor_ranks,
        pipeline_stages=c.stages,
        offload="always" if c.offload else "never")
