"""The overhead bench's real-simulator row: ManiSkill3 PushCube-v1 from state on ``physx_cpu``.

- **raw**: N processes, each stepping its share of the envs by itself (``gym.make`` envs of one scene each,
  as ManiSkill runs on CPU, uniformly random actions, ManiSkill's own time limit and resets): what the
  simulator gives on these cores with nothing else running;
- **ours**: the same envs in N env workers, each stepping its share in one simulator process
  (``env.num_procs=1``), driven by the rollout worker's policy through the channel (colocated), as
  ``embodied train`` collects: env-steps/s of the rollout (weight sync included, the update not: it is no
  simulator's cost). While one env worker's simulator steps, the rollout worker infers for the other.
  The default placement steps the envs inside the env workers (``env.num_procs=0``): measured at 0.72 of
  raw against 0.86 for this one (docs/results/overhead).

Their rounds alternate (raw for ``seconds``, then one of our rollouts) so that the machine's changing load
falls on both; one round of each is a warm-up.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection

import torch

from embodied.bench.loops import Measured, WorkersLoop
from embodied.config import compose
from envs.rendering import ensure_vulkan_icd

SIM = ["env=maniskill_pushcube", "env.sim_backend=physx_cpu", "env.num_envs=128", "env.num_procs=1",
       "policy=mlp", "placement.env_workers=2", "placement.rollout_workers=1", "placement.actor_workers=1",
       "placement.mode=colocated", "placement.env=0", "placement.rollout=0", "placement.actor=0"]


def _raw_process(conn: Connection, env_cfg, num_envs: int, seed: int) -> None:
    """Build ``num_envs`` envs, say "ready", then step them for each number of seconds received."""
    from envs.maniskill import make_gym_env, maniskill_spec

    ensure_vulkan_icd()  # as the env processes do: SAPIEN needs a Vulkan driver even for state
    spec = maniskill_spec(env_cfg)
    envs = [make_gym_env(spec, num_envs=1, sim_backend="physx_cpu") for _ in range(num_envs)]
    for k, env in enumerate(envs):
        env.reset(seed=seed + k)
    generator = torch.Generator().manual_seed(seed)
    action_dim = envs[0].action_space.shape[-1]
    conn.send("ready")
    while (seconds := conn.recv()) is not None:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            actions = torch.rand(num_envs, 1, action_dim, generator=generator) * 2 - 1
            for env, action in zip(envs, actions, strict=True):
                _, _, terminated, truncated, _ = env.step(action)
                if terminated.any() or truncated.any():
                    env.reset()
            steps += 1
        conn.send((steps * num_envs, time.perf_counter() - start))
    for env in envs:
        env.close()


class RawProcesses:
    """N processes stepping the simulator alone (:func:`_raw_process`)."""

    def __init__(self, env_cfg, processes: int):
        context = multiprocessing.get_context("spawn")  # nothing of this process's Ray or threads
        share = env_cfg.num_envs // processes
        self.conns, self.processes = [], []
        for p in range(processes):
            ours, theirs = context.Pipe()
            process = context.Process(target=_raw_process, args=(theirs, env_cfg, share, 1000 * p), daemon=True)
            process.start()
            self.conns.append(ours)
            self.processes.append(process)
        for conn in self.conns:
            conn.recv()  # "ready"

    def round(self, seconds: float) -> dict[str, float]:
        """All processes step for ``seconds`` at once; env-steps and the longest process's seconds."""
        for conn in self.conns:
            conn.send(seconds)
        results = [conn.recv() for conn in self.conns]
        return {"env_steps": sum(r[0] for r in results), "seconds": max(r[1] for r in results)}

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for process in self.processes:
            process.join(timeout=30)


def real_simulator_row(overrides: list[str], iterations: int, seconds: float) -> dict:
    """The row's summary: raw and ours env-steps/s over ``iterations`` measured rounds of each."""
    from embodied.runner import start_workers

    cfg = compose([*SIM, *overrides])
    processes = cfg.placement.env_workers * max(1, cfg.env.num_procs)  # the simulator processes ours runs
    raw = RawProcesses(cfg.env, processes)
    try:
        workers = start_workers(cfg)
        try:
            workers.reset_envs(iteration=0, sim_steps=0)
            steps = workers.steps_per_rollout
            raw_rounds, ours_rounds = [], []
            for i in range(iterations + 1):
                measured = raw.round(seconds)
                start = time.perf_counter()
                sync = workers.prepare_generation(force_sync=True)
                _, _, times = workers.rollout_steps(steps, i)
                if i > 0:  # the first is a warm-up
                    raw_rounds.append(measured)
                    ours_rounds.append({"iteration_s": time.perf_counter() - start, **sync, **times, "update_s": 0.0})
            env_steps = workers.layout.env_steps(steps)
        finally:
            workers.shutdown()
    finally:
        raw.close()
    raw_rate = sum(r["env_steps"] for r in raw_rounds) / sum(r["seconds"] for r in raw_rounds)
    mean = {k: sum(r[k] for r in ours_rounds) / len(ours_rounds) for k in ours_rounds[0]}
    ours = Measured("ours (collection)", mean["iteration_s"], env_steps, WorkersLoop.stages(mean))
    return {"overrides": [*SIM, *overrides], "ways": [{
        "way": f"{cfg.placement.mode}, {cfg.placement.env_workers} env worker(s) x {cfg.env.num_procs} sim processes",
        "plain": {"way": f"raw ({processes} processes)", "env_steps_per_s": raw_rate, "stages": {}},
        "ours": ours.row(), "ratio": ours.env_steps_per_s / raw_rate}]}
