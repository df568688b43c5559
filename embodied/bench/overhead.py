"""``embodied bench overhead``: the framework's own cost per step, against a plain loop, in one run.

For each setting (a batch size and an observation of the free simulator, ``env=free``: a step costs next
to nothing, so what is left is ours) it measures the same policy and algorithm two or three ways:

- **plain**: one process, no Ray: ``obs -> policy.act -> env.step`` for ``algorithm.rollout_steps`` steps,
  recorded by the rollout worker's own :class:`~embodied.workers.recorder.TrajectoryRecorder`, then the
  algorithm's update. What a single-file script would do, and the upper bound;
- **colocated**: the real workers (env, rollout, actor on Ray, the channel between env and rollout
  workers, weight sync), one iteration = weight sync + rollout + update, as ``embodied train`` runs it;
- **pipelined**: the same on two devices with two micro-batches overlapping (``placement.mode=hybrid``).

Each runs one warm-up iteration and ``iterations`` measured ones. It prints env-steps/s of each and the
ratio to the plain loop, then where an iteration's time goes: the simulator (``env.step``), the env
worker's messaging (its busy time beyond stepping: serialising and sending observations, episode rows),
the rollout worker's busy time (inference, sending actions, recording), the time workers wait on each
other, weight sync, and the update (the trajectory's transfer to the actor included).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from embodied.algorithms.registry import make_algorithm
from embodied.config import compose
from embodied.workers.recorder import TrajectoryRecorder
from envs.messages import StepMessage
from envs.registry import make_vec_env
from policies.registry import make_policy

BASE = ["env=free", "algorithm.rollout_steps=25", "placement.env_workers=1", "placement.rollout_workers=1",
        "placement.actor_workers=1"]
# (name, overrides): the grid; overrides given on the command line replace it by one setting
SETTINGS = [
    ("state, B=64", ["env.num_envs=64", "policy=mlp"]),
    ("state, B=256", ["env.num_envs=256", "policy=mlp"]),
    ("state, B=1024", ["env.num_envs=1024", "policy=mlp"]),
    ("state, B=4096", ["env.num_envs=4096", "policy=mlp"]),
    ("rgb 64 px, B=256", ["env.num_envs=256", "env.obs_mode=rgb", "env.image_size=64", "policy=cnn"]),
    ("rgb 128 px, B=64", ["env.num_envs=64", "env.obs_mode=rgb", "env.image_size=128", "policy=cnn"]),
]
COLOCATED = ["placement.mode=colocated", "placement.env=0", "placement.rollout=0", "placement.actor=0"]
PIPELINED = ["placement.mode=hybrid", "placement.env=0", "placement.rollout=1", "placement.actor=0-1",
             "placement.pipeline_stages=2"]


@dataclass
class Measured:
    """One way of running one setting: seconds per iteration, and per stage (keys: see :data:`STAGES`)."""

    way: str
    iteration_s: float
    env_steps_per_iteration: int
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps_per_iteration / self.iteration_s


STAGES = ("env", "env messaging", "rollout busy", "waiting", "weight sync", "update", "other")


def _mean(rows: list[dict]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def plain_loop(cfg, iterations: int) -> Measured:
    """The plain single-process loop (the module doc); torch's default threads (every core), as a script's."""
    env = make_vec_env(cfg.env)
    policy = make_policy(cfg.policy, env.obs_spec, env.action_dim)
    algorithm = make_algorithm(cfg.algorithm)
    optimizer = algorithm.make_optimizer(policy)
    generator = torch.Generator().manual_seed(0)
    steps, rows = cfg.algorithm.rollout_steps, []
    obs, _ = env.reset(seed=0)
    for i in range(iterations + 1):  # the first is a warm-up
        times = dict.fromkeys(("env", "rollout busy", "update"), 0.0)
        start = time.perf_counter()
        policy.eval()
        recorder = TrajectoryRecorder(algorithm.collection, policy.value)
        with torch.no_grad():
            for _ in range(steps):
                t0 = time.perf_counter()
                noise = torch.randn(env.num_envs, policy.noise_dim, generator=generator)
                actions, logprob, value = policy.act(obs, deterministic=False, noise=noise)
                env_actions = policy.to_env(actions, obs)
                recorder.decision(obs, actions, logprob, value)
                t1 = time.perf_counter()
                result = env.step(env_actions)
                t2 = time.perf_counter()
                recorder.outcome(StepMessage.of(result))
                obs = result.obs
                times["env"] += t2 - t1
                times["rollout busy"] += (t1 - t0) + (time.perf_counter() - t2)
            t0 = time.perf_counter()
            trajectory = recorder.finish(obs)
            times["rollout busy"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        policy.train()
        algorithm.update(policy, optimizer, trajectory, iteration=i, generator=generator)
        times["update"] = time.perf_counter() - t0
        if i > 0:
            rows.append({"iteration_s": time.perf_counter() - start, **times})
    env.close()
    mean = _mean(rows)
    stages = {k: mean.get(k, 0.0) for k in STAGES}
    stages["other"] = mean["iteration_s"] - sum(stages.values())
    return Measured("plain", mean["iteration_s"], steps * env.num_envs, stages)


def workers_loop(way: str, cfg, iterations: int) -> Measured:
    """The real workers, iterations as the trainer runs them (weight sync, rollout, update)."""
    from embodied.runner import start_workers

    workers = start_workers(cfg)
    try:
        workers.reset_envs(iteration=0, sim_steps=0)
        steps = workers.steps_per_rollout
        rows = []
        for i in range(iterations + 1):
            start = time.perf_counter()
            sync = workers.prepare_generation(force_sync=True)  # as after every update
            _, refs, times = workers.rollout_steps(steps, i)
            _, update = workers.update(refs, i)
            if i > 0:
                rows.append({"iteration_s": time.perf_counter() - start, **sync, **times, **update})
        env_steps = workers.layout.env_steps(steps)
    finally:
        workers.shutdown()
    m = _mean(rows)
    stages = {"env": m["env_step_s"], "env messaging": m["env_sim_s"] - m["env_step_s"],
              "rollout busy": m["infer_s"], "weight sync": m["weight_sync_s"], "update": m["update_s"]}
    # the rollout is env busy + rollout busy + both waiting on each other (and on Ray) in turn; pipelined,
    # the busy times overlap, and "waiting" is what is left of the rollout's wall time
    stages["waiting"] = m["rollout_s"] - stages["env"] - stages["env messaging"] - stages["rollout busy"]
    stages["other"] = m["iteration_s"] - m["rollout_s"] - stages["weight sync"] - stages["update"]
    return Measured(way, m["iteration_s"], env_steps, {k: stages[k] for k in STAGES})


def run(overrides: list[str], iterations: int = 2, out_dir: Path | None = None, progress: bool = True,
        pipelined: bool = True) -> dict:
    """Measure every setting (or the one ``overrides`` make); write ``results.json`` / ``results.md``."""
    settings = [("command line", overrides)] if overrides else SETTINGS
    ways = [("colocated", COLOCATED)] + ([("pipelined", PIPELINED)] if pipelined else [])
    results = []
    with tqdm(total=len(settings) * (1 + len(ways)), desc="bench overhead", unit="run", disable=not progress) as bar:
        for name, setting in settings:
            bar.set_postfix_str(name)
            measured = [plain_loop(compose([*BASE, *setting, *COLOCATED]), iterations)]
            bar.update(1)
            for way, placement in ways:
                measured.append(workers_loop(way, compose([*BASE, *setting, *placement]), iterations))
                bar.update(1)
            results.append({"setting": name, "overrides": [*BASE, *setting],
                            "ways": [{**asdict(m), "env_steps_per_s": m.env_steps_per_s} for m in measured]})
    summary = {"settings": results, "iterations": iterations}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "results.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    ways = [w["way"] for w in summary["settings"][0]["ways"]]
    head = " | ".join(f"{w} env-steps/s" + ("" if w == "plain" else f" | {w} / plain") for w in ways)
    lines = [f"| setting | {head} |", "|---|" + "---:|" * (2 * len(ways) - 1)]
    for s in summary["settings"]:
        plain = s["ways"][0]["env_steps_per_s"]
        cells = []
        for w in s["ways"]:
            cells.append(f"{w['env_steps_per_s']:,.0f}")
            if w["way"] != "plain":
                cells.append(f"{w['env_steps_per_s'] / plain:.2f}")
        lines.append(f"| {s['setting']} | {' | '.join(cells)} |")
    lines += ["", "Seconds per iteration, by stage (busy times overlap when pipelined):", "",
              "| setting | way | iteration | " + " | ".join(STAGES) + " |", "|---|---|" + "---:|" * (1 + len(STAGES))]
    for s in summary["settings"]:
        for w in s["ways"]:
            stages = " | ".join(f"{w['stages'][k]:.3f}" for k in STAGES)
            lines.append(f"| {s['setting']} | {w['way']} | {w['iteration_s']:.3f} | {stages} |")
    return "\n".join(lines) + "\n"
