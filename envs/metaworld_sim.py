"""One MetaWorld env (a :class:`~envs.subproc_child.SingleEnv`), as the env processes of
``env.backend=metaworld`` build it (envs/metaworld.py is the backend around it).

It runs in MetaWorld's own interpreter (``.venv-metaworld``: metaworld pins mujoco 3.3.0, LIBERO needs
2.3.7; docs/design/metaworld.md), so this module imports numpy and no torch, and metaworld only when it
builds an env. Everything the env needs from the suite (task names, encoded instructions) comes in its
:class:`MetaWorldSpec`.

Episodes are named by seeds as LIBERO's: ``seed = task_index * TASK_STRIDE + trial``. A trial is
MetaWorld's own randomisation of object and goal positions, drawn from the env's RNG seeded with
``TRIAL_SEED_BASE + trial`` (lerobot-eval's k-th episode of every task is seeded 1000 + k, through
``env.seed``: MetaWorld's ``reset(seed=...)`` ignores its seed) over the task object of
``MT1(name, seed=42).train_tasks[0]`` (lerobot's). Trials below :data:`TRAIN_TRIALS` are the evaluation
protocol's, the others training's.

Observations (``obs_mode``):

- ``state``: ``state`` float32 ``[39]``, MetaWorld's observation (hand xyz, gripper opening, the
  objects' poses, the previous frame's 18 numbers, the goal xyz): what a state policy needs;
- ``rgb``: ``rgb`` uint8 ``[S, S, 3]`` from the ``corner2`` camera moved to (0.75, 0.075, 0.7) and
  turned 180 degrees (both axes flipped), and ``state`` float32 ``[4]`` (hand xyz, gripper): what
  lerobot's and RLinf's MetaWorld evaluations feed pi0 / pi0.5 / SmolVLA;

both with ``task`` (one-hot float32 ``[num_tasks]``) and ``instruction`` (uint8 ``[L]``, the task's
language instruction: envs/base.py). Actions: 4 floats in [-1, 1], end-effector xyz delta and gripper.
Success is MetaWorld's ``info["success"]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

TASK_STRIDE = 1_000_000  # seeds per task
TRAIN_TRIALS = TASK_STRIDE // 2  # trials [0, this): evaluation's; [this, TASK_STRIDE): training's
TRIAL_SEED_BASE = 1000  # trial k's RNG seed is 1000 + k, lerobot-eval's seed of every task's k-th episode
TASK_OBJECT_SEED = 42  # MT1(name, seed=42).train_tasks[0], the task object lerobot's env sets
CAMERA = "corner2"
CAMERA_POS = (0.75, 0.075, 0.7)  # lerobot's and RLinf's corner2 ("align with sft", RLinf says)
STATE_DIMS = {"state": 39, "rgb": 4}  # obs_mode -> the state's size
ACTION_DIM = 4
MAX_PATH_LENGTH = 500  # MetaWorld's own episode length (it refuses to step past it)
RENDERINGS = ("fast", "reference")


def episode_seed(task_index: int, trial: int) -> int:
    return task_index * TASK_STRIDE + trial


def decode_seed(seed: int) -> tuple[int, int]:
    return divmod(int(seed), TASK_STRIDE)


@dataclass(frozen=True)
class MetaWorldSpec:
    tasks: tuple[str, ...]  # MetaWorld task names (``reach-v3``), the suite's order
    instructions: np.ndarray  # uint8 [num_tasks, L]: each task's instruction, encoded (envs/base.py)
    max_episode_steps: int
    image_size: int
    obs_mode: str = "state"  # "state" | "rgb"
    rendering: str = "fast"  # "fast" (no shadows, reflections or multisampling) | "reference" (MetaWorld's)
    settle_steps: int = 0  # zero actions after each reset, not counted against the limit (RLinf takes 15)


class MetaWorldEnv:
    """One MetaWorld env; builds the task a seed names (a switch of task rebuilds it, ~1 s)."""

    def __init__(self, spec: MetaWorldSpec):
        os.environ.setdefault("MUJOCO_GL", "egl")  # the CPU box has EGL (Mesa); osmesa is not installed
        self.spec = spec
        self.action_dim = ACTION_DIM
        self.max_episode_steps = spec.max_episode_steps
        self.env = None
        self.task_index: int | None = None
        self._observed: np.ndarray | None = None  # the last raw observation (observe=False steps)
        first = self.reset(episode_seed(0, 0))
        self.obs_spec = {k: (v.shape, v.dtype) for k, v in first.items()}

    def _build(self, task_index: int) -> None:
        import metaworld

        self.close()
        name, size = self.spec.tasks[task_index], self.spec.image_size
        benchmark = metaworld.MT1(name, seed=TASK_OBJECT_SEED)
        env = benchmark.train_classes[name](render_mode="rgb_array", camera_name=CAMERA, width=size, height=size)
        env.set_task(benchmark.train_tasks[0])
        env.model.cam_pos[env.model.camera(CAMERA).id] = CAMERA_POS
        env._freeze_rand_vec = False  # a fresh random vector at every reset ...
        env.seeded_rand_vec = True  # ... from env.np_random, which each reset seeds
        env.max_path_length = max(MAX_PATH_LENGTH, self.spec.max_episode_steps + self.spec.settle_steps)
        if self.spec.rendering == "fast":
            env.model.vis.quality.offsamples = 0
            env.model.vis.global_.offwidth = env.model.vis.global_.offheight = size
            env.model.mat_reflectance[:] = 0.0
        self.env, self.task_index = env, task_index
        self.task_one_hot = np.eye(len(self.spec.tasks), dtype=np.float32)[task_index]

    def _frame(self) -> np.ndarray:
        """The camera image, upright: MetaWorld's corner2 renders upside down and mirrored."""
        renderer = self.env.mujoco_renderer
        first = renderer.viewer is None
        viewer = renderer._get_viewer("rgb_array")
        if first and self.spec.rendering == "fast":
            import mujoco

            # shadows are most of a CPU frame's cost (93 -> 27 ms at 128 px)
            viewer.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        # each env has its own GL context holding its model's meshes and textures; gymnasium renders into
        # whichever is current (the last one made), so several envs in one process drew each other's assets
        viewer.make_context_current()
        return np.ascontiguousarray(self.env.render()[::-1, ::-1])

    def _obs(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        obs = {}
        if self.spec.obs_mode == "rgb":
            obs["rgb"] = self._frame()
        obs["state"] = np.asarray(raw[:STATE_DIMS[self.spec.obs_mode]], dtype=np.float32)
        obs["task"] = self.task_one_hot
        obs["instruction"] = self.spec.instructions[self.task_index]
        return obs

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        """Start the episode ``seed`` names (module doc). ``reconfigure`` changes nothing: MetaWorld's
        reset restarts MuJoCo's data and re-seeding fixes every random draw, so no earlier episode
        shapes this one."""
        task_index, trial = decode_seed(seed if seed is not None else 0)
        if task_index >= len(self.spec.tasks):
            raise ValueError(f"seed {seed} names task {task_index}; the suite has {len(self.spec.tasks)}")
        if task_index != self.task_index:
            self._build(task_index)
        self.env.seed(TRIAL_SEED_BASE + trial)
        raw, _ = self.env.reset()
        for _ in range(self.spec.settle_steps):
            raw, *_ = self.env.step(np.zeros(ACTION_DIM, dtype=np.float32))
        self.steps = 0
        self._observed = raw
        return self._obs(raw)

    def auto_reset_seed(self, last_seed: int, drawn: int) -> int:
        """The next training episode of this env: same task (no rebuild), a training trial ``drawn`` picks."""
        return episode_seed(decode_seed(last_seed)[0], TRAIN_TRIALS + drawn % TRAIN_TRIALS)

    def step(self, action: np.ndarray, observe: bool = True):
        """-> (obs or None, reward, terminated = success, truncated = the step limit, success)."""
        raw, reward, _, _, info = self.env.step(np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0))
        self.steps += 1
        self._observed = raw
        success = bool(info["success"])
        obs = self._obs(raw) if observe else None
        return obs, float(reward), success, self.steps >= self.max_episode_steps, success

    def observe(self) -> dict[str, np.ndarray]:
        return self._obs(self._observed)

    def render(self) -> np.ndarray:
        return self._frame()

    def close(self) -> None:
        if self.env is not None:
            self.env.close()  # frees the EGL context (else its __del__ complains at exit)
            self.env = None


def make_metaworld_env(spec: MetaWorldSpec, env_index: int) -> MetaWorldEnv:
    return MetaWorldEnv(spec)
