"""EnvWorker: owns a slice of the env batch and trades observations for actions over a Channel.

The slice is cut into ``stages`` micro-batches (``placement.pipeline_stages``), each
its own VecEnv. Per step and stage ``s`` the worker waits for actions under key
``("act", rank, s)``, steps that micro-batch and puts ``{obs, reward, terminated,
truncated, final_obs}`` under ``("obs", rank, s)``. While it steps micro-batch ``s``
the rollout worker is free to infer on micro-batch ``s - 1``: that is the pipeline.
With one stage the two take turns.
"""

from __future__ import annotations

import time

import torch

from envs.base import episode_rows
from envs.registry import make_vec_env
from scheduler.channel import Channel, InOrder
from scheduler.worker import Worker


class EnvWorker(Worker):
    def __init__(self, env_cfg, num_envs: int, stages: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.num_envs = num_envs
        self.stage_size = num_envs // stages
        # env.num_procs sim processes per worker, shared out over its micro-batches (0: in-process)
        procs = max(1, env_cfg.num_procs // stages) if env_cfg.num_procs else 0
        self.envs = [make_vec_env(env_cfg, num_envs=self.stage_size, num_procs=procs) for _ in range(stages)]
        self.obs: list[dict[str, torch.Tensor] | None] = [None] * stages
        self.trace: list[tuple[str, float, float]] = []  # (stage name, start, end), wall clock

    def spec(self) -> dict:
        env = self.envs[0]
        return {"obs_spec": env.obs_spec, "action_dim": env.action_dim,
                "max_episode_steps": env.max_episode_steps}

    def _reset(self, seeds: list[int], ignore_terminations: bool) -> None:
        for s, env in enumerate(self.envs):
            env.set_ignore_terminations(ignore_terminations)
            self.obs[s], _ = env.reset(seed=seeds[s * self.stage_size:(s + 1) * self.stage_size])

    def reset(self, seed: int) -> None:
        """Reset for training; env ``i`` of this rank is seeded ``seed + rank * num_envs + i``."""
        first = seed + self.rank * self.num_envs
        self._reset(list(range(first, first + self.num_envs)), ignore_terminations=False)

    def interact(self, num_steps: int, channel: Channel) -> dict:
        """Run ``num_steps`` steps of every micro-batch against a RolloutWorker.

        Returns ``episodes`` (rows of the episodes that finished; ``env`` indexes this
        rank's slice) and this rank's time busy stepping the simulator and sending the
        results (``sim_s``), of which ``env.step`` alone (``step_s``), and waiting for
        actions (``wait_s``).
        """
        self.trace = []
        started = time.perf_counter()
        for s, obs in enumerate(self.obs):
            channel.put({"obs": obs}, key=("obs", self.rank, s))
        episodes: list[dict] = []
        wait_s = step_s = 0.0
        keys = [("act", self.rank, s) for _ in range(num_steps) for s in range(len(self.envs))]
        actions_in = InOrder(channel, keys)  # the next micro-batch's actions are requested while this one steps
        for _ in range(num_steps):
            for s, env in enumerate(self.envs):
                t0 = time.perf_counter()
                actions = actions_in.next()
                t1, start = time.perf_counter(), time.time()
                result = env.step(actions)
                step_s += time.perf_counter() - t1
                for row in episode_rows(result.info["episode"], result.done, result.info.get("error")):
                    episodes.append({**row, "env": row["env"] + s * self.stage_size})
                channel.put(_message(result), key=("obs", self.rank, s))
                self.obs[s] = result.obs
                wait_s += t1 - t0
                self.trace.append(("sim", start, time.time()))
        busy_s = time.perf_counter() - started - wait_s
        return {"episodes": episodes, "sim_s": busy_s, "step_s": step_s, "wait_s": wait_s}

    def evaluate(self, seeds: list[int], channel: Channel) -> list[dict]:
        """One fixed-horizon episode per env, reset with ``seeds``; returns one row per episode."""
        self._reset(seeds, ignore_terminations=True)
        episodes = self.interact(self.envs[0].max_episode_steps, channel)["episodes"]
        for row in episodes:
            row["seed"] = seeds[row["env"]]
        return episodes

    def last_trace(self) -> list[tuple[str, float, float]]:
        return self.trace

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _message(result) -> dict:
    return {
        "obs": result.obs,
        "reward": result.reward,
        "terminated": result.terminated,
        "truncated": result.truncated,
        "final_obs": result.info["final_obs"] if bool(result.done.any()) else None,
    }
