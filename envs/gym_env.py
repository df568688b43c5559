"""A user's own gymnasium env as an env of the suite: ``env=gym env.task=<id>``.

``env.task`` is a gymnasium id (``Pendulum-v1``), or ``module:Id`` to import the module that registers
it first (gymnasium's own syntax: ``my_robots.tasks:Reach-v0``); each env process builds it with
``gymnasium.make(id, render_mode="rgb_array")``. The contract an env keeps to be trained and
evaluated here:

- **actions**: a 1-D ``Box``. Policies act in [-1, 1]; each action is mapped linearly onto the box's
  bounds where they are finite (left as is where they are not);
- **observations**: a ``Box`` becomes ``state`` (float32, flattened); a ``Dict`` keeps its ``Box`` keys,
  uint8 ``[H, W, 3]`` ones as camera images (name one ``rgb`` for the image policies) and the others
  as float32 vectors (name the proprioception ``state``);
- **success**: ``info["success"]`` (or ``info["is_success"]``, gymnasium-robotics' name) after each step,
  truthy when the task is done; an env that never reports it scores 0 in every table;
- **instruction** (language-conditioned policies): a string attribute ``instruction`` of the env
  (``env.unwrapped.instruction``), read after each reset, at most 128 UTF-8 bytes; it becomes the
  ``instruction`` observation as LIBERO's does;
- **episodes**: ``reset(seed=...)`` must make the episode the seed names (the evaluation is then
  reproducible to the episode); the step limit is ``env.max_episode_steps``, else the id's registered
  ``max_episode_steps``; ``terminated`` ends a training episode (success or failure), the limit truncates
  it; evaluations run every episode to the limit (``success_once``: success at any step), so a step
  after ``terminated`` must be harmless;
- **videos**: ``render()`` returns an RGB array.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from envs.base import INSTRUCTION_BYTES, encode_instruction
from envs.common import UserError
from envs.registry import EnvMemory, GiB, register_env, register_env_resources
from envs.subproc import SubprocVecEnv

SUCCESS_KEYS = ("success", "is_success")


@dataclass(frozen=True)
class GymSpec:
    task: str
    max_episode_steps: int | None


def _make(task: str, max_episode_steps: int | None):
    """``gymnasium.make``; ``max_episode_steps`` (env.max_episode_steps) replaces the id's time limit."""
    import gymnasium as gym

    limit = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    try:
        return gym.make(task, render_mode="rgb_array", **limit)
    except TypeError:  # an env without render_mode: it simply cannot record videos
        return gym.make(task, **limit)


class GymEnv:
    """One gymnasium env behind :class:`~envs.subproc_child.SingleEnv` (the contract: module doc)."""

    def __init__(self, spec: GymSpec):
        self.env = _make(spec.task, spec.max_episode_steps)
        space = self.env.action_space
        if len(getattr(space, "shape", None) or ()) != 1:
            raise UserError(f"env.task={spec.task}: its action space is {space}, and the suite's policies act in a "
                            "1-D Box. Wrap the env to take a Box of continuous actions.")
        self.action_dim = space.shape[0]
        low, high = space.low.astype(np.float64), space.high.astype(np.float64)
        self.bounded = np.isfinite(low) & np.isfinite(high)
        self.low, self.high = np.where(self.bounded, low, -1.0), np.where(self.bounded, high, 1.0)
        registered = self.env.spec.max_episode_steps if self.env.spec else None
        if spec.max_episode_steps is None and registered is None:
            raise UserError(f"env.task={spec.task} registers no max_episode_steps: set env.max_episode_steps to "
                            "the episode's step limit.")
        self.max_episode_steps = spec.max_episode_steps or registered
        first = self.reset(0)
        self.obs_spec = {k: (v.shape, v.dtype) for k, v in first.items()}

    def _obs(self, raw) -> dict[str, np.ndarray]:
        if isinstance(raw, dict):
            obs = {k: _field(np.asarray(v)) for k, v in raw.items() if np.asarray(v).dtype != object}
        else:
            obs = {"state": np.asarray(raw, dtype=np.float32).reshape(-1)}
        text = getattr(self.env.unwrapped, "instruction", None)
        if isinstance(text, str):
            if len(text.encode()) > INSTRUCTION_BYTES:
                raise UserError(f"the env's instruction has {len(text.encode())} bytes; the gym contract allows "
                                f"{INSTRUCTION_BYTES} (envs/gym_env.py). Shorten it.")
            obs["instruction"] = encode_instruction(text, INSTRUCTION_BYTES)
        return obs

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        raw, _ = self.env.reset(seed=None if seed is None else int(seed))
        self.steps = 0
        return self._obs(raw)

    def step(self, action: np.ndarray, observe: bool = True):
        """-> (obs, reward, terminated, truncated = the step limit, success); actions from [-1, 1] to the box."""
        a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        scaled = np.where(self.bounded, self.low + (a + 1.0) * 0.5 * (self.high - self.low), a)
        raw, reward, terminated, truncated, info = self.env.step(scaled.astype(self.env.action_space.dtype))
        self.steps += 1
        success = any(bool(info.get(key, False)) for key in SUCCESS_KEYS)
        done_by_limit = bool(truncated) or self.steps >= self.max_episode_steps
        return self._obs(raw), float(reward), bool(terminated), done_by_limit, success

    def observe(self) -> dict[str, np.ndarray]:
        raise NotImplementedError("GymEnv always returns its observation from step()")

    def render(self) -> np.ndarray:
        frame = self.env.render()
        if frame is None:
            raise RuntimeError("this gymnasium env renders no RGB array (render_mode='rgb_array'): run without "
                               "videos (eval.video_episodes=0 eval.videos_per_task=0)")
        return np.asarray(frame, dtype=np.uint8)

    def close(self) -> None:
        self.env.close()


def _field(value: np.ndarray) -> np.ndarray:
    """A Dict observation's value: camera images stay uint8 ``[H, W, 3]``; the rest float32 vectors."""
    if value.dtype == np.uint8 and value.ndim == 3:
        return value
    return value.astype(np.float32).reshape(-1)


def _make_gym_env(spec: GymSpec, env_index: int) -> GymEnv:
    return GymEnv(spec)


def validate_gym(cfg) -> None:
    """The id resolves (its module imports, gymnasium knows it) and the env keeps the contract's action
    space and step limit, checked on one env built here, before any env process starts."""
    import gymnasium as gym

    module, _, name = cfg.task.rpartition(":")
    try:
        if module:
            __import__(module)
        gym.spec(name)
    except ModuleNotFoundError as err:
        raise UserError(f"env.task={cfg.task}: cannot import {module!r} ({err}). Put the module that registers the "
                        "env on PYTHONPATH, or install its package.") from None
    except gym.error.Error as err:
        raise UserError(f"env.task={cfg.task} is not a registered gymnasium env ({err}). Register it with "
                        "gymnasium.register(...) in a module and name it as module:Id.") from None
    GymEnv(GymSpec(cfg.task, cfg.max_episode_steps)).close()


def gym_render_problem(cfg) -> str | None:
    """Video frames come from an ``rgb`` observation, else from ``render()``: tried once on an env built here."""
    env = GymEnv(GymSpec(cfg.task, cfg.max_episode_steps))
    try:
        if "rgb" not in env.obs_spec:
            env.render()
    except Exception as err:  # whatever the env's renderer raises (a missing pygame, no render_mode)
        return f"env.task={cfg.task} cannot render video frames ({type(err).__name__}: {err})."
    finally:
        env.close()
    return None


@register_env("gym", validate=validate_gym, render_problem=gym_render_problem)
def make_gym(cfg, num_envs: int, num_procs: int) -> SubprocVecEnv:
    """``num_envs`` gymnasium envs over ``num_procs`` processes (0: stepped in the calling process)."""
    spec = GymSpec(cfg.task, cfg.max_episode_steps)
    return SubprocVecEnv(functools.partial(_make_gym_env, spec), num_envs, num_procs, timeout_s=cfg.timeout_s,
                         restart_crashed=cfg.restart_crashed, startup_timeout_s=cfg.startup_timeout_s)


@functools.cache
def _built_obs_spec(task: str, max_episode_steps: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    env = GymEnv(GymSpec(task, max_episode_steps))
    try:
        return {k: (tuple(shape), np.dtype(dtype).name) for k, (shape, dtype) in env.obs_spec.items()}
    finally:
        env.close()


def gym_obs_spec(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """A user's env says what it observes only once built: one is built here (as ``validate_gym`` does)."""
    return _built_obs_spec(cfg.task, cfg.max_episode_steps)


# RSS of a process stepping gymnasium envs: ~0.25 GiB measured (Pendulum-v1; a user's env may need far more, which
# this cannot know); envs stepped in the env worker add little to it
PROCESS_BYTES = int(0.25 * GiB)
PER_ENV_BYTES = 8 * 2**20


def gym_memory(cfg, num_envs: int, num_procs: int) -> EnvMemory:
    if num_procs == 0:
        return EnvMemory(0, 0, num_envs * PER_ENV_BYTES, "envs stepped in the env worker")
    procs = min(num_procs, num_envs)
    return EnvMemory(procs, PROCESS_BYTES + -(-num_envs // procs) * PER_ENV_BYTES, 0,
                     f"{procs} process(es), ~0.25 GiB each (classic control; a user's env may need more)")


register_env_resources("gym", obs_spec=gym_obs_spec, memory=gym_memory)
