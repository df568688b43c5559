"""A free simulator: a batched, in-process env whose step costs next to nothing (``env=free``).

What it is for: measuring the framework's own cost per step (``embodied bench overhead``), where a real
simulator's step time would hide it, and tests that need a real registered env that starts at once. It is
a task of its own, not a stand-in for any simulator: a point in the cube [-1, 1]^8 moves by 0.1 x the
action (8 floats in [-1, 1]) toward a goal; the reward is minus the distance over its initial value
(dense); success (which ends the episode) is a distance under 0.2; the limit is ``env.max_episode_steps``
(default 50).

Observations, ``B`` envs:

- ``state`` float32 ``[B, 42]``: position (8), goal (8), goal - position (8), then zeros;
- ``env.obs_mode=rgb`` adds ``rgb`` uint8 ``[B, S, S, 3]`` (``S`` = ``env.image_size``): black, with the
  position's first two coordinates one white pixel and the goal's one red pixel.

Episodes are named by seeds as everywhere (envs/seeds.py): a seed's initial position and goal come from a
counter-based hash (splitmix64) of the seed, vectorized over the batch, so a seed names the same episode
in any env and any batch.
"""

from __future__ import annotations

import numpy as np
import torch

from envs.base import EpisodeTracker, Obs, StepResult
from envs.common import UserError
from envs.registry import EnvMemory, register_env, register_env_resources
from envs.seeds import AutoResets

ACTION_DIM = 8
STATE_DIM = 42
SPEED = 0.1  # position change per step at a full action
SUCCESS_DISTANCE = 0.2
DEFAULT_STEPS = 50
TASKS = ("reach",)


def _uniform(seeds: np.ndarray, count: int) -> np.ndarray:
    """``count`` floats in [-1, 1) per seed (float64 ``[len(seeds), count]``): splitmix64 of (seed, k)."""
    with np.errstate(over="ignore"):
        x = seeds.astype(np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15) + np.arange(1, count + 1,
                                                                                          dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


class FreeVecEnv:
    """``num_envs`` free envs stepped together as torch tensors (the module doc)."""

    def __init__(self, num_envs: int, max_episode_steps: int, image_size: int | None):
        self.num_envs = num_envs
        self.action_dim = ACTION_DIM
        self.max_episode_steps = max_episode_steps
        self.image_size = image_size
        self.device = torch.device("cpu")
        self.obs_spec = {"state": ((STATE_DIM,), torch.float32)}
        if image_size:
            self.obs_spec["rgb"] = ((image_size, image_size, 3), torch.uint8)
        self.position = torch.zeros(num_envs, ACTION_DIM)
        self.goal = torch.zeros(num_envs, ACTION_DIM)
        self.start_distance = torch.ones(num_envs)
        self.seeds = np.zeros(num_envs, dtype=np.int64)  # each env's current episode seed
        self.steps = torch.zeros(num_envs, dtype=torch.long)  # each env's steps in its episode
        self.clock = 0  # simulator steps since reset(): what auto-reset seeds are indexed by
        self.auto_resets: AutoResets | None = None
        self.ignore_terminations = False
        self.tracker = EpisodeTracker(num_envs)
        self.rows = torch.arange(num_envs)

    def _start(self, envs: torch.Tensor, seeds: np.ndarray) -> None:
        """Start the episodes ``seeds`` name in ``envs`` (indices)."""
        draws = torch.from_numpy(_uniform(seeds, 2 * ACTION_DIM)).float()
        self.position[envs], self.goal[envs] = draws[:, :ACTION_DIM], draws[:, ACTION_DIM:]
        self.start_distance[envs] = (self.goal[envs] - self.position[envs]).norm(dim=1).clamp_min(1e-3)
        self.seeds[envs.numpy()] = seeds
        self.steps[envs] = 0

    def _obs(self) -> Obs:
        state = torch.zeros(self.num_envs, STATE_DIM)
        state[:, :ACTION_DIM], state[:, ACTION_DIM:2 * ACTION_DIM] = self.position, self.goal
        state[:, 2 * ACTION_DIM:3 * ACTION_DIM] = self.goal - self.position
        obs = {"state": state}
        if self.image_size:
            obs["rgb"] = self._image()
        return obs

    def _image(self) -> torch.Tensor:
        size = self.image_size
        image = torch.zeros(self.num_envs, size, size, 3, dtype=torch.uint8)
        pixel = lambda xy: ((xy + 1) * 0.5 * (size - 1)).round().long().clamp(0, size - 1)  # noqa: E731
        where, goal = pixel(self.position[:, :2]), pixel(self.goal[:, :2])
        image[self.rows, where[:, 1], where[:, 0]] = 255
        image[self.rows, goal[:, 1], goal[:, 0], 0] = 255
        return image

    def reset(self, seed: int | list[int] | None = None, reconfigure: bool = False,
              auto_resets: AutoResets | None = None) -> tuple[Obs, dict]:
        """``seed``: int (env ``i`` gets ``seed + i``), a list, or None (seeds 0 ..). ``reconfigure``
        changes nothing: there is no scene to leave anything behind."""
        if seed is None or isinstance(seed, int):
            seeds = np.arange(self.num_envs, dtype=np.int64) + (seed or 0)
        else:
            seeds = np.asarray(seed, dtype=np.int64)
        self._start(self.rows, seeds)
        self.clock, self.auto_resets = 0, auto_resets
        self.tracker.reset()
        return self._obs(), {}

    def _next_seeds(self, envs: torch.Tensor) -> np.ndarray:
        """The seeds of the episodes ``envs`` start by themselves (envs/seeds.py's auto-reset stream)."""
        index = envs.numpy().astype(np.int64)
        if self.auto_resets is None:  # a stream of each env's last seed: seeded use repeats exactly
            return (_uniform(self.seeds[index] ^ self.clock, 1)[:, 0] * 2**30 + 2**30).astype(np.int64)
        auto = self.auto_resets
        return auto.stream.seeds((auto.first_step + self.clock) * auto.num_envs + auto.first_env + index)

    def step(self, actions: torch.Tensor, observe: bool = True) -> StepResult:
        """Move every point by ``actions`` float ``[B, 8]``; envs whose episode ended start the next."""
        self.position = (self.position + SPEED * actions.float().clamp(-1, 1)).clamp(-1, 1)
        self.steps += 1
        self.clock += 1
        distance = (self.goal - self.position).norm(dim=1)
        reward = -distance / self.start_distance
        success = distance < SUCCESS_DISTANCE
        terminated = success & (not self.ignore_terminations)
        truncated = self.steps >= self.max_episode_steps
        done = terminated | truncated
        final_obs = self._obs()
        ended = done.nonzero().flatten()
        obs = final_obs
        if len(ended):
            self._start(ended, self._next_seeds(ended))
            obs = self._obs()
        info = {"success": success, "final_obs": final_obs, "episode": self.tracker.update(reward, success, done)}
        return StepResult(obs, reward, terminated, truncated, info)

    def set_ignore_terminations(self, flag: bool) -> None:
        self.ignore_terminations = flag

    def render(self, env_index: int = 0) -> np.ndarray:
        size = self.image_size or 64
        frame = FreeVecEnv(1, self.max_episode_steps, size)
        frame.position, frame.goal = self.position[env_index:env_index + 1], self.goal[env_index:env_index + 1]
        return frame._image()[0].numpy()

    def close(self) -> None:
        pass


def validate_free(cfg) -> None:
    if cfg.task not in TASKS:
        raise UserError(f"env.task={cfg.task!r} is not a task of the free simulator: it has one, 'reach' "
                        "(envs/free_env.py).")
    if cfg.obs_mode not in ("state", "rgb"):
        raise UserError(f"env.obs_mode={cfg.obs_mode!r}: the free simulator observes 'state' (42 floats) or 'rgb' "
                        "(an image of env.image_size, plus the state).")


def free_obs_keys(cfg) -> dict[str, tuple[int, ...]]:
    keys = {"state": (STATE_DIM,)}
    if cfg.obs_mode == "rgb":
        keys["rgb"] = (cfg.image_size, cfg.image_size, 3)
    return keys


@register_env("free", validate=validate_free, action_dim=lambda cfg: ACTION_DIM,
              episode_steps=lambda cfg: cfg.max_episode_steps or DEFAULT_STEPS, obs_keys=free_obs_keys)
def make_free(cfg, num_envs: int, num_procs: int) -> FreeVecEnv:
    """All ``num_envs`` in the calling process (``num_procs`` is ignored: a step costs less than a message)."""
    return FreeVecEnv(num_envs, cfg.max_episode_steps or DEFAULT_STEPS,
                      cfg.image_size if cfg.obs_mode == "rgb" else None)


def free_obs_spec(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (shape, "uint8" if k == "rgb" else "float32") for k, shape in free_obs_keys(cfg).items()}


def free_memory(cfg, num_envs: int, num_procs: int) -> EnvMemory:
    """A few tensors of ``num_envs`` rows in the env worker (~10 MiB measured at 256 envs)."""
    return EnvMemory(0, 0, 16 * 2**20, "tensors in the env worker")


register_env_resources("free", obs_spec=free_obs_spec, memory=free_memory)
