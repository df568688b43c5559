"""``embodied plan [overrides] [--devices N] [--profile P] [--devices-per-node G] [--network-gbps B]``:
the candidate plans (placement x pipeline stages x actor ranks x offload) for a config, predicted from
its stage profile, best first; run nothing.

The profile is ``--profile``'s file, else the cache under ``placement.profile_dir``, else measured now
on this machine. ``--devices`` / ``--devices-per-node`` / ``--network-gbps`` ask "what if": size a
cluster from a profile taken on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from embodied.commands.common import (
    composed_overrides,
    config_command,
    printed_job_config,
)
from embodied.config import compose
from envs.common import UserError
from scheduler.cost_model import Network
from scheduler.placement import to_placement
from scheduler.planner import plan
from scheduler.runtime.cluster import cluster_devices, start_cluster


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``plan``: the config flags and overrides, and the what-if flags of the cluster planned for."""
    config_command(subparsers, "plan", "candidate plans predicted from a stage profile", __doc__, run,
                   flags=_what_if_flags)


def _what_if_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, metavar="N", help="plan for this many devices (what-if)")
    parser.add_argument("--profile", metavar="P", help="a saved profile (JSON) instead of this machine's")
    parser.add_argument("--devices-per-node", type=int, metavar="G", help="nodes of this many devices (what-if)")
    parser.add_argument("--network-gbps", type=float, default=100.0, metavar="B",
                        help="link between nodes, Gb/s (default: 100)")
    parser.add_argument("--json", action="store_true", help="print the candidates as JSON")


def run(args: argparse.Namespace) -> int:
    """``plan``, or with ``--cfg job`` the config it would plan for."""
    overrides = composed_overrides(args)
    if printed_job_config(args, lambda: compose(overrides)):
        return 0
    return show_plans(overrides, args.devices, args.profile, args.json, args.devices_per_node, args.network_gbps)


def show_plans(overrides: list[str], devices: int | None, profile_path: str | None, as_json: bool,
               devices_per_node: int | None = None, network_gbps: float = 100.0) -> int:
    """The candidate plans for a config, predicted from its profile (``profile_path`` or the cache;
    measured now if neither has it), for this machine's devices or ``devices`` (what-if), on nodes of
    ``devices_per_node`` devices joined by ``network_gbps`` links; printed as a table or JSON."""
    from embodied.runner import STAGE_RUNNERS
    from scheduler.auto import profile_sizes, workload_of
    from scheduler.profiler import cached_profile, load

    if (devices_per_node is not None and devices_per_node < 1) or network_gbps <= 0:
        raise UserError(f"--devices-per-node {devices_per_node} / --network-gbps {network_gbps}: both must be "
                        "positive (e.g. --devices 64 --devices-per-node 8 --network-gbps 100).")
    network = Network(devices_per_node, network_gbps)
    cfg = compose(overrides)
    if profile_path is not None:
        if not Path(profile_path).exists():
            raise UserError(f"--profile {profile_path}: no such file. Profiles are written by `embodied plan` and "
                            f"`placement.mode=auto` runs under placement.profile_dir ({cfg.placement.profile_dir}).")
        profile, source = load(Path(profile_path)), Path(profile_path)
    else:
        start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
        here = cluster_devices()
        devices = devices or len(here.devices)
        profile, source, _ = cached_profile(cfg, profile_sizes(cfg.env.num_envs), len(here.devices),
                                            Path(cfg.placement.profile_dir), STAGE_RUNNERS,
                                            log=lambda m: print(m, file=sys.stderr))
    devices = devices or 1
    workload = workload_of(cfg, profile, STAGE_RUNNERS.algorithm(cfg.algorithm))  # as auto placement
    choice = plan(profile, workload, devices, offload=profile.device_kind == "gpu", network=network)
    nodes = -(-devices // devices_per_node) if devices_per_node else 1
    if as_json:
        print(json.dumps({"profile": str(source), "devices": devices, "nodes": nodes,
                          "best": choice.best and choice.best.candidate.name(),
                          "candidates": [{"plan": p.candidate.name(), "predicted_s": p.iteration_s,
                                          "feasible": p.feasible, "why": p.infeasible} for p in choice.table]},
                         indent=2))
        return 0
    where = f" on {nodes} nodes ({network.gbps:g} Gb/s links)" if nodes > 1 else ""
    print(f"profile: {source}; {devices} device(s){where}; {cfg.env.num_envs} envs\n")
    print(choice.markdown())
    if choice.best is not None:
        best = to_placement(choice.best.candidate, cfg.placement)
        keys = ("mode", "env", "rollout", "actor", "env_workers", "rollout_workers", "pipeline_stages", "offload")
        print("\nrun it with: " + " ".join(f"placement.{k}={getattr(best, k)}" for k in keys))
    return 0
