"""EnvWorker: owns a slice of the env batch and trades observations for actions over a Channel.

The slice is cut into ``stages`` micro-batches (``placement.pipeline_stages``, sizes from the
run's :class:`~scheduler.runtime.layout.BatchLayout`), each its own VecEnv. Per step and stage ``s``
the worker waits for actions under ``action_key(rank, s)``, steps that micro-batch and puts a
:class:`~envs.messages.StepMessage` under ``observation_key(rank, s)``. While it steps
micro-batch ``s`` the rollout worker is free to infer on micro-batch ``s - 1``: that is the
pipeline. With one stage the two take turns. With ``chunk_size > 1`` each step is a chunk of
that many simulator steps (:class:`envs.chunking.ChunkedVecEnv`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from envs.base import episode_rows
from envs.chunking import ChunkedVecEnv
from envs.messages import EnvEvaluation, EnvRollout, EnvSpec, StepMessage
from envs.registry import make_vec_env
from envs.seeds import AutoResets
from scheduler.runtime.channel import Channel, InOrder, action_key, observation_key
from scheduler.runtime.layout import BatchLayout
from scheduler.runtime.worker import Worker, resident_mib


class EnvWorker(Worker):
    # answered while a step runs: `embodied chaos` asks which simulator process to kill mid-rollout
    extra_control_methods = ("simulator_pids",)

    def __init__(self, env_cfg, layout: BatchLayout, **kwargs):
        super().__init__(**kwargs)
        self.env_cfg = env_cfg
        self.layout = layout
        self.stage_size = layout.stage_size
        # env.num_procs sim processes per worker, shared out over its micro-batches (0: in-process)
        procs = max(1, env_cfg.num_procs // layout.stages) if env_cfg.num_procs else 0
        self.envs = [make_vec_env(env_cfg, num_envs=self.stage_size, num_procs=procs) for _ in range(layout.stages)]
        if layout.chunk_size > 1:
            self.envs = [ChunkedVecEnv(env, layout.chunk_size) for env in self.envs]
        self.obs: list[dict[str, torch.Tensor] | None] = [None] * layout.stages
        self.trace: list[tuple[str, float, float]] = []  # (stage name, start, end), wall clock

    def spec(self) -> EnvSpec:
        env = self.envs[0]
        return EnvSpec(env.obs_spec, env.action_dim, env.max_episode_steps)

    def observations(self) -> dict[str, torch.Tensor]:
        """The first micro-batch's current observations (the profiler times the policy on them)."""
        return self.obs[0]

    def memory_mib(self) -> float:
        """This worker's resident memory: its simulator's, as the profiler records it."""
        return resident_mib()

    def _reset(self, seeds: list[int], ignore_terminations: bool, reconfigure: bool = False,
               auto_resets: AutoResets | None = None) -> None:
        for s, env in enumerate(self.envs):
            env.set_ignore_terminations(ignore_terminations)
            first = self.layout.stage_slice(s).start
            self.obs[s], _ = env.reset(seed=seeds[self.layout.stage_slice(s)], reconfigure=reconfigure,
                                       auto_resets=auto_resets.shifted(first) if auto_resets else None)

    def reset(self, seeds: list[int], auto_resets: AutoResets, success_ends_episode: bool = True) -> None:
        """Reset this rank's envs for training with ``seeds`` (one per env, from the training
        stream: see ``Workers.reset_envs``); ``auto_resets`` (this rank's slice) seeds the
        episodes that follow, which end at success or, if not ``success_ends_episode``, only
        at the time limit."""
        self._reset(seeds, ignore_terminations=not success_ends_episode, auto_resets=auto_resets)

    def interact(self, num_steps: int, channel: Channel, on_step: Callable | None = None) -> EnvRollout:
        """Run ``num_steps`` steps of every micro-batch against a RolloutWorker.

        Returns the finished episodes and this rank's times (:class:`~envs.messages.EnvRollout`).
        ``on_step(stage, result)`` sees every step's result.
        """
        self.trace = []
        started = time.perf_counter()
        for s, obs in enumerate(self.obs):
            channel.put(StepMessage(obs), key=observation_key(self.rank, s))
        episodes: list[dict] = []
        wait_s = step_s = 0.0
        keys = [action_key(self.rank, s) for _ in range(num_steps) for s in range(len(self.envs))]
        actions_in = InOrder(channel, keys)  # the next micro-batch's actions are requested while this one steps
        for _ in range(num_steps):
            for s, env in enumerate(self.envs):
                t0 = time.perf_counter()
                with self.waiting():
                    actions = actions_in.next()
                t1, start = time.perf_counter(), time.time()
                result = env.step(actions)
                step_s += time.perf_counter() - t1
                for row in episode_rows(result.info["episode"], result.done, result.info.get("error")):
                    episodes.append({**row, "env": row["env"] + s * self.stage_size})
                channel.put(StepMessage.of(result), key=observation_key(self.rank, s))
                self.obs[s] = result.obs
                if on_step is not None:
                    on_step(s, result)
                wait_s += t1 - t0
                self.trace.append(("sim", start, time.time()))
        busy_s = time.perf_counter() - started - wait_s
        return EnvRollout(episodes, busy_s, step_s, wait_s)

    def evaluate(self, seeds: list[int], episode_ids: list[int], record: list[bool], channel: Channel,
                 reconfigure: bool = True) -> EnvEvaluation:
        """One fixed-horizon episode per env, reset with ``seeds`` (``reconfigure``: scenes rebuilt
        first, so an episode depends only on its seed and the weights, never on what ran before).

        Returns the rows (one per episode, tagged with ``seed`` and ``episode`` = its
        ``episode_ids`` entry; ids < 0 are padding, run but not reported) and the videos of the
        envs flagged in ``record`` (:class:`~envs.messages.EnvEvaluation`).
        """
        self._reset(seeds, ignore_terminations=True, reconfigure=reconfigure)
        recorders = {i: _EpisodeFrames(self._frame(i, self.obs[i // self.stage_size], None))
                     for i, flag in enumerate(record) if flag}

        def on_step(stage: int, result) -> None:
            for i, frames in recorders.items():
                if i // self.stage_size == stage:
                    for step in result.info.get("steps", [result]):  # an action chunk: each of its steps
                        if not frames.ended:
                            frames.add(self._frame(i, step.obs, step), step, i % self.stage_size)

        self._observe_every_step({i // self.stage_size for i in recorders})  # a video shows every step
        try:
            rows = self.interact(self.envs[0].max_episode_steps, channel, on_step if recorders else None).episodes
        finally:
            self._observe_every_step(set())
        for row in rows:
            row["seed"], row["episode"] = seeds[row["env"]], episode_ids[row["env"]]
        return EnvEvaluation([r for r in rows if r["episode"] >= 0],
                             {episode_ids[i]: frames.as_dict() for i, frames in recorders.items()})

    def _observe_every_step(self, stages: set[int]) -> None:
        """Chunked micro-batches in ``stages`` observe each of their steps, the others only the
        last step of a chunk (see envs/chunking.py)."""
        for s, env in enumerate(self.envs):
            if isinstance(env, ChunkedVecEnv):
                env.observe_every_step = s in stages

    def _frame(self, i: int, obs: dict, result) -> np.ndarray:
        """The picture of env ``i`` after a step: its camera (agentview beside wrist view, if
        there is one) or, for state observations, a render. The last step shows the final obs."""
        stage, local = divmod(i, self.stage_size)
        if result is not None and bool(result.done[local]):
            obs = result.info["final_obs"]
        if "rgb" not in obs:
            return self.envs[stage].render(local)
        views = [obs["rgb"][local]] + ([obs["wrist_rgb"][local]] if "wrist_rgb" in obs else [])
        return torch.cat([torch.as_tensor(v) for v in views], dim=1).numpy()

    def last_trace(self) -> list[tuple[str, float, float]]:
        return self.trace

    def simulator_pids(self) -> list[int]:
        """The pids of this worker's simulator processes (``env.num_procs > 0``; none in-process)."""
        return [proc.pid for env in self.envs for proc in getattr(_unchunked(env), "_procs", [])]

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _unchunked(env):
    return env.env if isinstance(env, ChunkedVecEnv) else env


class _EpisodeFrames:
    """Frames of one recorded eval episode with the reward and success shown under each."""

    def __init__(self, first: np.ndarray):
        self.frames, self.rewards, self.successes = [first], [None], [False]
        self.ended = False  # the episode is over: what follows (the rest of a chunk) is the next one

    def add(self, frame: np.ndarray, result, local: int) -> None:
        self.ended = bool(result.done[local])
        self.frames.append(frame)
        self.rewards.append(float(result.reward[local]))
        self.successes.append(bool(result.info["success"][local]))

    def as_dict(self) -> dict:
        return {"frames": np.stack(self.frames), "rewards": self.rewards, "successes": self.successes}

