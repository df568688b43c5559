"""A user's own gymnasium env, registered the way a user's package would register it: the gym adapter's
test subject (tests/test_gym_env.py). A point on a line must reach a goal; Dict observations with a
proprioceptive ``state`` and a camera ``rgb``; actions in [-2, 2]; ``info["success"]`` and an ``instruction``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class LineReach(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}
    instruction = "move the point to the goal"

    def __init__(self, render_mode: str | None = None):
        self.render_mode = render_mode
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self.observation_space = gym.spaces.Dict({
            "state": gym.spaces.Box(-np.inf, np.inf, (2,), np.float64),
            "rgb": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)})

    def _obs(self) -> dict:
        image = np.zeros((8, 8, 3), np.uint8)
        image[:, int(np.clip((self.x + 5) / 10 * 7, 0, 7))] = 255
        return {"state": np.array([self.x, self.goal]), "rgb": image}

    def reset(self, seed: int | None = None, options=None):
        super().reset(seed=seed)
        self.x = self.np_random.uniform(-4, 4)
        self.goal = self.x + self.np_random.uniform(-1.5, 1.5)  # one full step away at most
        return self._obs(), {}

    def step(self, action):
        self.last_action = float(action[0])
        self.x += self.last_action
        success = abs(self.x - self.goal) < 0.5
        return self._obs(), -abs(self.x - self.goal), success, False, {"success": success}

    def render(self):
        return np.repeat(np.repeat(self._obs()["rgb"], 8, 0), 8, 1)


gym.register(id="LineReach-v0", entry_point=LineReach, max_episode_steps=20)


class BlindLineReach(LineReach):
    """The same task seen through its state alone, with no renderer (render() gives nothing): videos must be off."""

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)

    def _obs(self):
        return np.array([self.x, self.goal])

    def render(self):
        return None


gym.register(id="BlindLineReach-v0", entry_point=BlindLineReach, max_episode_steps=20)
