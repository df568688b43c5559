"""``embodied bench overhead``: the framework's own cost per step, against a plain loop, in one run.

For each setting of the free simulator (``env=free``: a step costs next to nothing, so what is left is
ours; a batch size and an observation) it measures the same policy and algorithm two ways, their
iterations interleaved (plain, ours, plain, ours, ...) so that a machine's changing load falls on both:

- **plain**: one process, no Ray: ``obs -> policy.act -> env.step`` for ``algorithm.rollout_steps`` steps,
  recorded by the rollout worker's own :class:`~embodied.workers.recorder.TrajectoryRecorder`, then the
  algorithm's update. What a single-file script would do, and the upper bound;
- **ours**: the real workers (env, rollout, actor on Ray, the channel between env and rollout workers,
  weight sync), one iteration = weight sync + rollout + update, as ``embodied train`` runs it, either
  **colocated** (one device) or **pipelined** (two devices, two micro-batches overlapping).

Each runs one warm-up iteration and ``iterations`` measured ones. It prints env-steps/s of each and the
ratio, then where an iteration's time goes: the simulator (``env.step``), the env worker's messaging (its
busy time beyond stepping: serialising and sending observations, episode rows), the rollout worker's busy
time (inference, sending actions, recording), the time workers wait on each other, weight sync, and the
update (the trajectory's transfer to the actor included). PPO's KL early stop is off, so both loops run
the same number of epochs.

The real-simulator row (``maniskill-cpu``, :mod:`embodied.bench.raw_sim`) compares collection alone: our
env workers' simulator processes driven by the rollout worker, against as many processes stepping the
simulator by themselves.

Settings are named (:data:`SETTINGS`); ``embodied bench overhead state-4096 rgb64-256`` runs those, other
arguments are config overrides applied to each (one unnamed setting when no name is given).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from embodied.bench.loops import STAGES, interleaved
from embodied.bench.raw_sim import real_simulator_row
from embodied.config import compose
from envs.common import unknown_name_error

BASE = ["env=free", "algorithm.rollout_steps=25", "algorithm.target_kl=null", "placement.env_workers=1",
        "placement.rollout_workers=1", "placement.actor_workers=1"]
# id -> (label, overrides): the grid and the real-simulator row
SETTINGS = {
    "state-64": ("state, B=64", ["env.num_envs=64", "policy=mlp"]),
    "state-256": ("state, B=256", ["env.num_envs=256", "policy=mlp"]),
    "state-1024": ("state, B=1024", ["env.num_envs=1024", "policy=mlp"]),
    "state-4096": ("state, B=4096", ["env.num_envs=4096", "policy=mlp"]),
    "rgb64-256": ("rgb 64 px, B=256", ["env.num_envs=256", "env.obs_mode=rgb", "env.image_size=64", "policy=cnn"]),
    "rgb128-64": ("rgb 128 px, B=64", ["env.num_envs=64", "env.obs_mode=rgb", "env.image_size=128", "policy=cnn"]),
    "maniskill-cpu": ("ManiSkill PushCube-v1 state, CPU, B=128", []),  # raw_sim.py's
}
REAL_SIMULATOR = "maniskill-cpu"
WAYS = {
    "colocated": ["placement.mode=colocated", "placement.env=0", "placement.rollout=0", "placement.actor=0"],
    "pipelined": ["placement.mode=hybrid", "placement.env=0", "placement.rollout=1", "placement.actor=0-1",
                  "placement.pipeline_stages=2"],
}


def _pick(arguments: list[str]) -> tuple[list[str], list[str]]:
    """(setting ids, config overrides) of the command line; a word that is neither is refused."""
    for word in arguments:
        if word not in SETTINGS and "=" not in word:
            raise unknown_name_error("overhead setting (embodied bench overhead <setting> ...)", word, list(SETTINGS))
    return [a for a in arguments if a in SETTINGS], [a for a in arguments if a not in SETTINGS]


def run(arguments: list[str], iterations: int = 2, out_dir: Path | None = None, progress: bool = True,
        ways: tuple[str, ...] = ("colocated", "pipelined"), sim_seconds: float = 20.0) -> dict:
    """Measure the named settings (all of :data:`SETTINGS` if none is named and no override is given);
    write ``results.json`` / ``results.md``."""
    ids, overrides = _pick(arguments)
    if not ids:
        ids = [None] if overrides else list(SETTINGS)
    results = []
    with tqdm(total=len(ids) * len(ways), desc="bench overhead", unit="run", disable=not progress) as bar:
        for setting in ids:
            label, setting_overrides = SETTINGS[setting] if setting else ("command line", [])
            bar.set_postfix_str(label)
            if setting == REAL_SIMULATOR:
                results.append({"setting": label, **real_simulator_row(overrides, iterations, sim_seconds)})
                bar.update(len(ways))
                continue
            chosen = [*BASE, *setting_overrides, *overrides]
            rows = []
            for way in ways:
                plain, ours = interleaved(way, compose([*chosen, *WAYS["colocated"]]),
                                          compose([*chosen, *WAYS[way]]), iterations)
                rows.append({"way": way, "plain": plain.row(), "ours": ours.row(),
                             "ratio": ours.env_steps_per_s / plain.env_steps_per_s})
                bar.update(1)
            results.append({"setting": label, "overrides": chosen, "ways": rows})
    summary = {"settings": results, "iterations": iterations, "plain_threads": torch.get_num_threads()}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "results.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    lines = ["| setting | ours | baseline env-steps/s | ours env-steps/s | ours / baseline |",
             "|---|---|---:|---:|---:|"]
    for s in summary["settings"]:
        for w in s["ways"]:
            lines.append(f"| {s['setting']} | {w['way']} | {w['plain']['env_steps_per_s']:,.0f} "
                         f"| {w['ours']['env_steps_per_s']:,.0f} | {w['ratio']:.2f} |")
    lines += ["", "Baseline: the plain one-process loop (free simulator), or the simulator's processes stepping "
              "alone (real simulator: collection only).", "",
              "Seconds per iteration, by stage (busy times overlap when pipelined):", "",
              "| setting | way | iteration | " + " | ".join(STAGES) + " |", "|---|---|" + "---:|" * (1 + len(STAGES))]
    for s in summary["settings"]:
        for w in s["ways"]:
            for m in (w["plain"], w["ours"]):
                if not m.get("stages"):
                    continue
                name = m["way"] if m["way"] != "plain" else f"plain (beside {w['way']})"
                stages = " | ".join(f"{m['stages'][k]:.3f}" for k in STAGES)
                lines.append(f"| {s['setting']} | {name} | {m['iteration_s']:.3f} | {stages} |")
    return "\n".join(lines) + "\n"
