"""Demonstrations from ManiSkill's own motion planners (shipped in mani_skill), in our control mode.

The planners drive absolute joint targets (``pd_joint_pos``); our envs take normalised joint
deltas (``pd_joint_delta_pos``: ``target = qpos + 0.1 * action``). Each planner step is
recorded as the observation before it and the delta action that reaches the same target,
``(target - qpos) / 0.1`` clipped to [-1, 1], with the gripper command unchanged, so the
PD controller sees the same targets. Replayed in ``pd_joint_delta_pos``, 19 of 20
PushCube / PickCube demos succeed again (the 20th misses by a clipped step).

Shapes: ``obs[k]: [N, ...]`` (the env's observations, e.g. ``rgb`` uint8 ``[N, H, W, 3]``),
``actions: [N, A]``, ``episode: [N]`` (which demo a step belongs to); for off-policy RL on demos
(RLPD), ``rewards: [N]`` (the env's reward for the step, ``env.reward_mode``), ``success: [N]``
(the task was solved after the step) and ``next_obs[k]: [N, ...]`` (the observation it led to).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from envs.common import Registry
from envs.maniskill import (
    ManiSkillSpec,
    as_obs_dict,
    default_max_episode_steps,
    instruction_for,
    make_gym_env,
)
from envs.rendering import ensure_vulkan_icd

DELTA_SCALE = 0.1  # pd_joint_delta_pos: one unit of action moves a joint target by 0.1 rad
# task -> "module:function" of its planner solution in mani_skill.examples.motionplanning.panda.solutions
PLANNERS = Registry("motion-planner demo task (env.task)")
PLANNERS.update({
    "PushCube-v1": "push_cube:solve",
    "PickCube-v1": "pick_cube:solve",
    "StackCube-v1": "stack_cube:solve",
    "PullCube-v1": "pull_cube:solve",
})

@dataclass
class Demos:
    obs: dict[str, torch.Tensor]
    actions: torch.Tensor
    episode: torch.Tensor
    seeds: list[int]  # the reset seed of each kept demo
    task: str
    instruction: str
    rewards: torch.Tensor
    success: torch.Tensor
    next_obs: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return self.actions.shape[0]

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dataclasses.asdict(self), path)
        return path

    @classmethod
    def load(cls, path: Path) -> Demos:
        return cls(**torch.load(path, weights_only=False))


def _planner(task: str):
    module, function = PLANNERS.get(task).split(":")
    solutions = importlib.import_module(f"mani_skill.examples.motionplanning.panda.solutions.{module}")
    return getattr(solutions, function)


class _Recorder:
    """Wraps the planner's env: keeps each step's observation and the delta action it amounts to."""

    def __init__(self, env):
        self.env = env
        self.obs: list[dict] = []
        self.actions: list[np.ndarray] = []
        self.next_obs: list[dict] = []
        self.rewards: list[float] = []
        self.successes: list[bool] = []
        self.success = False

    def __getattr__(self, name):  # the planner reads env.unwrapped, action_space, ...
        return getattr(self.env, name)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.obs, self.actions, self.success, self._last = [], [], False, obs
        self.next_obs, self.rewards, self.successes = [], [], []
        return obs, info

    def step(self, action):
        target = np.asarray(action, dtype=np.float32).reshape(-1)
        qpos = self.env.unwrapped.agent.robot.get_qpos()[0, :7].cpu().numpy()
        delta = np.clip((target[:7] - qpos) / DELTA_SCALE, -1.0, 1.0)
        self.obs.append({k: v[0].cpu() for k, v in as_obs_dict(self._last).items()})
        self.actions.append(np.concatenate([delta, target[7:]]).astype(np.float32))
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._last = obs
        self.next_obs.append({k: v[0].cpu() for k, v in as_obs_dict(obs).items()})
        self.rewards.append(float(reward[0]))
        self.successes.append(bool(info["success"][0]))
        self.success |= self.successes[-1]
        return obs, reward, terminated, truncated, info


def generate_demos(env_cfg, episodes: int, seed: int, progress: bool = True) -> Demos:
    """Run the task's motion planner from seeds ``seed, seed + 1, ...`` until ``episodes``
    successful demos are recorded (failed plans are skipped, at most ``2 * episodes`` tries)."""
    ensure_vulkan_icd()
    solve = _planner(env_cfg.task)
    spec = ManiSkillSpec(env_cfg.task, env_cfg.obs_mode, "pd_joint_pos", env_cfg.reward_mode,
                         4 * default_max_episode_steps(env_cfg.task), env_cfg.image_size, env_cfg.render_size, "cpu")
    env = _Recorder(make_gym_env(spec, num_envs=1, sim_backend="physx_cpu"))
    obs, actions, episode, seeds, next_obs, rewards, success = [], [], [], [], [], [], []
    bar = tqdm(total=episodes, unit="demo", desc="demos", disable=not progress, file=sys.stderr)
    try:
        for s in range(seed, seed + 2 * episodes):
            if len(seeds) == episodes:
                break
            solve(env, seed=s)
            if not env.success:
                continue
            obs += env.obs
            actions += env.actions
            next_obs += env.next_obs
            rewards += env.rewards
            success += env.successes
            episode += [len(seeds)] * len(env.actions)
            seeds.append(s)
            bar.update(1)
    finally:
        bar.close()
        env.env.close()
    def stacked(steps: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([o[k] for o in steps]) for k in steps[0]}

    return Demos(stacked(obs), torch.from_numpy(np.stack(actions)), torch.tensor(episode), seeds, env_cfg.task,
                 instruction_for(env_cfg.task), torch.tensor(rewards, dtype=torch.float32), torch.tensor(success),
                 stacked(next_obs))
