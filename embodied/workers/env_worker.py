"""EnvWorker: owns a slice of the env batch and trades observations for actions over a Channel.

Per step it puts ``{obs, reward, terminated, truncated, success, final_obs}`` under
key ``("obs", rank)`` and waits for actions under ``("act", rank)``.
"""

from __future__ import annotations

import time

import torch

from envs.base import episode_rows
from envs.registry import make_vec_env
from scheduler.channel import Channel
from scheduler.worker import Worker


class EnvWorker(Worker):
    def __init__(self, env_cfg, num_envs: int, **kwargs):
        super().__init__(**kwargs)
        self.num_envs = num_envs
        self.env = make_vec_env(env_cfg, num_envs=num_envs)
        self.obs: dict[str, torch.Tensor] | None = None

    def spec(self) -> dict:
        return {"obs_spec": self.env.obs_spec, "action_dim": self.env.action_dim,
                "max_episode_steps": self.env.max_episode_steps}

    def reset(self, seed: int) -> None:
        """Reset for training; env ``i`` of this rank is seeded ``seed + rank * num_envs + i``."""
        self.env.set_ignore_terminations(False)
        self.obs, _ = self.env.reset(seed=seed + self.rank * self.num_envs)

    def interact(self, num_steps: int, channel: Channel) -> dict:
        """Run ``num_steps`` steps against a RolloutWorker.

        Returns ``episodes`` (rows of the episodes that finished) and this rank's time
        spent stepping the simulator (``sim_s``) and waiting for actions (``wait_s``).
        """
        channel.put({"obs": self.obs}, key=("obs", self.rank))
        episodes: list[dict] = []
        sim_s = wait_s = 0.0
        for _ in range(num_steps):
            t0 = time.perf_counter()
            actions = channel.get(key=("act", self.rank))
            t1 = time.perf_counter()
            result = self.env.step(actions)
            sim_s += time.perf_counter() - t1
            wait_s += t1 - t0
            done = result.done
            episodes += episode_rows(result.info["episode"], done)
            channel.put(
                {
                    "obs": result.obs,
                    "reward": result.reward,
                    "terminated": result.terminated,
                    "truncated": result.truncated,
                    "final_obs": result.info["final_obs"] if bool(done.any()) else None,
                },
                key=("obs", self.rank),
            )
            self.obs = result.obs
        return {"episodes": episodes, "sim_s": sim_s, "wait_s": wait_s}

    def evaluate(self, seeds: list[int], channel: Channel) -> list[dict]:
        """One fixed-horizon episode per env, reset with ``seeds``; returns one row per episode."""
        self.env.set_ignore_terminations(True)
        self.obs, _ = self.env.reset(seed=seeds)
        episodes = self.interact(self.env.max_episode_steps, channel)["episodes"]
        for row in episodes:
            row["seed"] = seeds[row["env"]]
        return episodes

    def close(self) -> None:
        self.env.close()
