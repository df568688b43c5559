"""The two loops :mod:`embodied.bench.overhead` compares, and their interleaved measurement.

- :class:`PlainLoop`: one process, no Ray, ``obs -> policy.act -> env.step`` recorded by the rollout worker's
  own recorder, then the algorithm's update;
- :class:`WorkersLoop`: the real workers, an iteration as ``embodied train`` runs it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from embodied.algorithms.registry import make_algorithm
from embodied.workers.recorder import TrajectoryRecorder
from envs.messages import StepMessage
from envs.registry import make_vec_env
from policies.registry import make_policy

STAGES = ("env", "env messaging", "rollout busy", "waiting", "weight sync", "update", "other")


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

    def row(self) -> dict:
        return {**asdict(self), "env_steps_per_s": self.env_steps_per_s}


def _mean(rows: list[dict]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


class PlainLoop:
    """The plain single-process loop (the module doc), in the calling process with its torch threads."""

    def __init__(self, cfg):
        self.env = make_vec_env(cfg.env)
        self.policy = make_policy(cfg.policy, self.env.obs_spec, self.env.action_dim)
        self.algorithm = make_algorithm(cfg.algorithm)
        self.optimizer = self.algorithm.make_optimizer(self.policy)
        self.generator = torch.Generator().manual_seed(0)
        self.steps = cfg.algorithm.rollout_steps
        self.obs, _ = self.env.reset(seed=0)

    @property
    def env_steps(self) -> int:
        return self.steps * self.env.num_envs

    def iteration(self, i: int) -> dict[str, float]:
        """One rollout and update; seconds of the whole and of its stages."""
        env, policy = self.env, self.policy
        times = dict.fromkeys(("env", "rollout busy", "update"), 0.0)
        start = time.perf_counter()
        policy.eval()
        recorder = TrajectoryRecorder(self.algorithm.collection, policy.value)
        with torch.no_grad():
            for _ in range(self.steps):
                t0 = time.perf_counter()
                noise = torch.randn(env.num_envs, policy.noise_dim, generator=self.generator)
                actions, logprob, value = policy.act(self.obs, deterministic=False, noise=noise)
                env_actions = policy.to_env(actions, self.obs)
                recorder.decision(self.obs, actions, logprob, value)
                t1 = time.perf_counter()
                result = env.step(env_actions)
                t2 = time.perf_counter()
                recorder.outcome(StepMessage.of(result))
                self.obs = result.obs
                times["env"] += t2 - t1
                times["rollout busy"] += (t1 - t0) + (time.perf_counter() - t2)
            t0 = time.perf_counter()
            trajectory = recorder.finish(self.obs)
            times["rollout busy"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        policy.train()
        self.algorithm.update(policy, self.optimizer, trajectory, iteration=i, generator=self.generator)
        times["update"] = time.perf_counter() - t0
        return {"iteration_s": time.perf_counter() - start, **times}

    @staticmethod
    def stages(mean: dict[str, float]) -> dict[str, float]:
        stages = {k: mean.get(k, 0.0) for k in STAGES}
        stages["other"] = mean["iteration_s"] - sum(stages.values())
        return stages

    def close(self) -> None:
        self.env.close()


class WorkersLoop:
    """The real workers, iterations as the trainer runs them (weight sync, rollout, update)."""

    def __init__(self, cfg):
        from embodied.runner import start_workers

        self.workers = start_workers(cfg)
        self.workers.reset_envs(iteration=0, sim_steps=0)
        self.steps = self.workers.steps_per_rollout

    @property
    def env_steps(self) -> int:
        return self.workers.layout.env_steps(self.steps)

    def iteration(self, i: int) -> dict[str, float]:
        start = time.perf_counter()
        sync = self.workers.prepare_generation(force_sync=True)  # as after every update
        _, refs, times = self.workers.rollout_steps(self.steps, i)
        _, update = self.workers.update(refs, i)
        return {"iteration_s": time.perf_counter() - start, **sync, **times, **update}

    @staticmethod
    def stages(m: dict[str, float]) -> dict[str, float]:
        stages = {"env": m["env_step_s"], "env messaging": m["env_sim_s"] - m["env_step_s"],
                  "rollout busy": m["infer_s"], "weight sync": m["weight_sync_s"], "update": m["update_s"]}
        # the rollout is env busy + rollout busy + both waiting on each other (and on Ray) in turn; pipelined,
        # the busy times overlap, and "waiting" is what is left of the rollout's wall time
        stages["waiting"] = m["rollout_s"] - stages["env"] - stages["env messaging"] - stages["rollout busy"]
        stages["other"] = m["iteration_s"] - m["rollout_s"] - stages["weight sync"] - stages["update"]
        return {k: stages[k] for k in STAGES}

    def close(self) -> None:
        self.workers.shutdown()


def interleaved(way: str, plain_cfg, ours_cfg, iterations: int) -> tuple[Measured, Measured]:
    """(plain, ours): one warm-up iteration of each, then ``iterations`` of each, alternating."""
    plain = PlainLoop(plain_cfg)
    try:
        ours = WorkersLoop(ours_cfg)
        try:
            rows: dict[str, list[dict]] = {"plain": [], way: []}
            for i in range(iterations + 1):
                for name, loop in (("plain", plain), (way, ours)):
                    times = loop.iteration(i)
                    if i > 0:  # the first is a warm-up
                        rows[name].append(times)
            measured = []
            for name, loop in (("plain", plain), (way, ours)):
                mean = _mean(rows[name])
                measured.append(Measured(name, mean["iteration_s"], loop.env_steps, loop.stages(mean)))
        finally:
            ours.close()
    finally:
        plain.close()
    return measured[0], measured[1]
