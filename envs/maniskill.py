"""ManiSkill3 behind the :class:`~envs.base.VecEnv` protocol.

Two backends, chosen by ``env.sim_backend``:

* ``physx_cpu``: one SAPIEN scene per env (ManiSkill allows only one per process
  on CPU), vectorized with :class:`~envs.subproc.SubprocVecEnv`.
* ``physx_cuda``: ``num_envs`` scenes in one process on the GPU.

``auto`` picks ``physx_cuda`` when CUDA is available, else ``physx_cpu``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from envs.base import EpisodeTracker, Obs, StepResult, encode_instruction, instruction_width
from envs.common import UserError, unknown_name_error
from envs.registry import EnvMemory, GiB, register_env, register_env_resources
from envs.rendering import ensure_vulkan_icd
from envs.subproc import SubprocVecEnv


@dataclass(frozen=True)
class ManiSkillSpec:
    """Everything needed to build one ManiSkill env (picklable, sent to workers)."""

    task: str
    obs_mode: str  # "state" | "rgb"
    control_mode: str
    reward_mode: str
    max_episode_steps: int
    image_size: int
    render_size: int
    render_backend: str


# the language instruction of a task, added to rgb observations (for VLA policies)
INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the goal region",
    "PickCube-v1": "pick up the cube and move it to the goal",
    "StackCube-v1": "stack the red cube on the green cube",
    "PullCube-v1": "pull the cube to the goal region",
}


def instruction_for(task: str) -> str:
    """The task's instruction; other tasks get their name ("PegInsertionSide-v1" -> "peg insertion side")."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = task.split("-v")[0]
    return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()


def known_tasks() -> list[str]:
    from mani_skill.utils.registration import REGISTERED_ENVS

    return sorted(REGISTERED_ENVS)


def default_max_episode_steps(task: str) -> int:
    from mani_skill.utils.registration import REGISTERED_ENVS

    return int(REGISTERED_ENVS[task].max_episode_steps or 100)


def make_gym_env(spec: ManiSkillSpec, num_envs: int, sim_backend: str):
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper

    env = gym.make(
        spec.task,
        num_envs=num_envs,
        obs_mode=spec.obs_mode,
        control_mode=spec.control_mode,
        reward_mode=spec.reward_mode,
        sim_backend=sim_backend,
        render_backend=spec.render_backend,
        render_mode="rgb_array",
        max_episode_steps=spec.max_episode_steps,
        sensor_configs=dict(width=spec.image_size, height=spec.image_size),
        human_render_camera_configs=dict(width=spec.render_size, height=spec.render_size),
    )
    if spec.obs_mode != "state":
        env = WithInstruction(FlattenRGBDObservationWrapper(env, rgb=True, depth=False, state=True),
                               instruction_for(spec.task), num_envs)
    return env


class WithInstruction(gym.ObservationWrapper):
    """Adds ``instruction``: the task's one instruction, uint8 ``[num_envs, L]`` (UTF-8, zero-padded;
    ``L`` = :func:`envs.base.instruction_width` of it: 128 unless it is longer)."""

    def __init__(self, env, text: str, num_envs: int):
        super().__init__(env)
        row = encode_instruction(text)  # just wide enough: the env shows no other instruction
        self.instruction = torch.from_numpy(row).expand(num_envs, -1).contiguous()

    def observation(self, observation):
        return {**observation, "instruction": self.instruction.to(observation["rgb"].device)}


def as_obs_dict(obs) -> dict[str, torch.Tensor]:
    return {"state": obs} if isinstance(obs, torch.Tensor) else dict(obs)


class ManiSkillCPUEnv:
    """One ``physx_cpu`` ManiSkill env with numpy I/O (a :class:`~envs.subproc.SingleEnv`)."""

    def __init__(self, spec: ManiSkillSpec):
        ensure_vulkan_icd()
        self.spec = spec
        self.env = make_gym_env(spec, num_envs=1, sim_backend="physx_cpu")
        self.max_episode_steps = spec.max_episode_steps
        self.action_dim = int(np.prod(self.env.action_space.shape[-1:]))
        first = self.reset(0)
        self.obs_spec = {k: (v.shape, v.dtype) for k, v in first.items()}

    @staticmethod
    def _numpy(obs) -> dict[str, np.ndarray]:
        return {k: v[0].cpu().numpy() for k, v in as_obs_dict(obs).items()}

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        """``reconfigure``: rebuild the PhysX scene (~0.3 s on CPU). A seeded reset alone sets every
        pose and velocity, yet what PhysX keeps of earlier episodes (contact pairs and their
        order; nothing the API clears) still changes some later episodes: ManiSkill's
        evaluation protocol reconfigures at every evaluation reset, and so do we."""
        if not reconfigure:
            return self._numpy(self.env.reset(seed=seed)[0])
        with _collect_later():
            obs, _ = self.env.reset(seed=seed, options={"reconfigure": True})
        return self._numpy(obs)

    def step(self, action: np.ndarray, observe: bool = True):
        """-> (obs, reward, terminated, truncated, success); ``observe=False``: obs is None and no
        camera is rendered (a render costs ~60x the physics step of PushCube on CPU)."""
        if not observe and self.spec.obs_mode != "state":
            return self._step_unobserved(action)
        obs, reward, terminated, truncated, info = self.env.step(torch.from_numpy(action[None]))
        return self._numpy(obs), float(reward[0]), bool(terminated[0]), bool(truncated[0]), _success(info)

    def _step_unobserved(self, action: np.ndarray):
        """ManiSkill's own ``step`` on the unwrapped env with its observation mode set to
        ``state`` for the call: proprioception instead of camera renders; reward, success
        and termination are computed as usual (ManiSkill's rewards read poses, not the
        observation). The wrappers only transform observations, except the time limit,
        which is applied here as ManiSkill's TimeLimitWrapper does."""
        base = self.env.unwrapped
        mode, base._obs_mode = base._obs_mode, "state"
        try:
            _, reward, terminated, _, info = base.step(torch.from_numpy(action[None]))
        finally:
            base._obs_mode = mode
        truncated = base.elapsed_steps[0] >= self.max_episode_steps
        return None, float(reward[0]), bool(terminated[0]), bool(truncated), _success(info)

    def observe(self) -> dict[str, np.ndarray]:
        """The current observation, through the same wrappers as ``step``'s."""
        obs, wrappers, env = self.env.unwrapped.get_obs(), [], self.env
        while isinstance(env, gym.Wrapper):
            wrappers.append(env)
            env = env.env
        for wrapper in reversed(wrappers):  # innermost first
            if isinstance(wrapper, gym.ObservationWrapper):
                obs = wrapper.observation(obs)
        return self._numpy(obs)

    def render(self) -> np.ndarray:
        return self.env.render()[0].cpu().numpy()

    def close(self) -> None:
        self.env.close()


class _NoCollect:
    """``gc`` as ManiSkill's scene teardown sees it inside :func:`_collect_later`."""

    def __getattr__(self, name: str):
        return getattr(gc, name)

    def collect(self, generation: int = 2) -> int:
        return 0


@contextlib.contextmanager
def _collect_later():
    """ManiSkill's scene teardown runs a full ``gc.collect()``: 0.16 of the 0.20 s a CPU
    reconfigure takes in a process with torch loaded. Skipped here: the caller resetting a
    batch of envs collects once, after the last (EnvBatch.reset)."""
    import mani_skill.envs.sapien_env as sapien_env

    sapien_env.gc = _NoCollect()
    try:
        yield
    finally:
        sapien_env.gc = gc


def _success(info: dict) -> bool:
    """The one env's success flag (tasks without one never succeed)."""
    return bool(info["success"][0]) if "success" in info else False


def _make_cpu_env(spec: ManiSkillSpec, env_index: int) -> ManiSkillCPUEnv:
    return ManiSkillCPUEnv(spec)


class ManiSkillGPUVecEnv:
    """``num_envs`` ManiSkill envs simulated together with ``physx_cuda``."""

    def __init__(self, spec: ManiSkillSpec, num_envs: int):
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        self.spec = spec
        self.num_envs = num_envs
        self.max_episode_steps = spec.max_episode_steps
        base = make_gym_env(spec, num_envs=num_envs, sim_backend="physx_cuda")
        self.env = ManiSkillVectorEnv(base, num_envs, auto_reset=True)
        self.device = torch.device("cuda")
        self.action_dim = int(self.env.single_action_space.shape[-1])
        obs, _ = self.env.reset(seed=0)
        self.obs_spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in as_obs_dict(obs).items()}
        self.tracker = EpisodeTracker(num_envs)

    def reset(self, seed: int | list[int] | None = None, reconfigure: bool = False,
              auto_resets=None) -> tuple[Obs, dict]:
        """``auto_resets`` is not used: ManiSkill's GPU vector env resets finished envs with seeds
        of its own, drawn from the reset seeds (docs/seeds.md)."""
        obs, info = self.env.reset(seed=seed, options={"reconfigure": True} if reconfigure else None)
        self.tracker.reset()
        return as_obs_dict(obs), {}

    def step(self, actions: torch.Tensor, observe: bool = True) -> StepResult:
        """``observe`` is ignored: the GPU renders every env of the batch at once, cheaply."""
        obs, reward, terminated, truncated, info = self.env.step(actions.to(self.device))
        done = terminated | truncated
        success = info.get("success", torch.zeros_like(done))
        final_obs = as_obs_dict(obs)
        if "final_observation" in info:
            final_obs = as_obs_dict(info["final_observation"])
            success = torch.where(done, info["final_info"]["success"], success)
        out_info = {
            "success": success,
            "final_obs": final_obs,
            "episode": self.tracker.update(reward, success, done),
        }
        return StepResult(as_obs_dict(obs), reward.float(), terminated, truncated, out_info)

    def set_ignore_terminations(self, flag: bool) -> None:
        self.env.ignore_terminations = flag

    def render(self, env_index: int = 0) -> np.ndarray:
        return self.env.render()[env_index].cpu().numpy()

    def close(self) -> None:
        self.env.close()


def validate_maniskill(cfg) -> None:
    if cfg.task not in known_tasks():
        raise unknown_name_error("ManiSkill task (env.task)", cfg.task, known_tasks())
    if cfg.obs_mode not in ("state", "rgb"):
        raise UserError(f"env.obs_mode={cfg.obs_mode!r} is not supported: use 'state' or 'rgb'.")
    if cfg.sim_backend not in ("auto", "physx_cpu", "physx_cuda"):
        raise UserError(f"env.sim_backend={cfg.sim_backend!r}: use 'auto', 'physx_cpu' or 'physx_cuda'.")
    if cfg.sim_backend == "physx_cuda" and not torch.cuda.is_available():
        raise UserError("env.sim_backend=physx_cuda needs a CUDA GPU and none is visible: "
                        "use env.sim_backend=physx_cpu (or auto).")
    if cfg.rendering != "fast":  # the key exists for LIBERO, whose checkpoints need robosuite's defaults
        raise UserError(f"env.rendering={cfg.rendering} is LIBERO's: 'reference' renders LIBERO scenes with "
                        "robosuite's defaults, as the public checkpoints' authors do. ManiSkill renders one way; "
                        "leave env.rendering=fast.")
    if cfg.protocol != "default":  # LIBERO's too: the reference evaluations' resets and seeds
        raise UserError(f"env.protocol={cfg.protocol} is LIBERO's (lerobot's and openpi's evaluation resets and "
                        "seeds). ManiSkill episodes start one way; leave env.protocol=default.")


# the Panda arm's action sizes per controller (7 joints + gripper; end effector + gripper)
PANDA_ACTION_DIMS = {"pd_joint_delta_pos": 8, "pd_joint_pos": 8, "pd_joint_target_delta_pos": 8,
                     "pd_ee_delta_pos": 4, "pd_ee_target_delta_pos": 4, "pd_ee_delta_pose": 7,
                     "pd_ee_target_delta_pose": 7}


def panda_action_dim(cfg) -> int | None:
    """The action size of the Panda tasks this project names (INSTRUCTIONS), else None."""
    return PANDA_ACTION_DIMS.get(cfg.control_mode) if cfg.task in INSTRUCTIONS else None


def maniskill_obs_keys(cfg) -> dict[str, tuple[int, ...] | None]:
    """What the ManiSkill env observes, known from the config alone (the state's size is the task's)."""
    if cfg.obs_mode != "rgb":
        return {"state": None}
    return {"rgb": (cfg.image_size, cfg.image_size, 3), "state": None, "instruction": None}


def maniskill_spec(cfg) -> ManiSkillSpec:
    """What one env of the :class:`~embodied.config.EnvConfig` ``cfg`` is built from."""
    return ManiSkillSpec(
        task=cfg.task,
        obs_mode=cfg.obs_mode,
        control_mode=cfg.control_mode,
        reward_mode=cfg.reward_mode,
        max_episode_steps=cfg.max_episode_steps or default_max_episode_steps(cfg.task),
        image_size=cfg.image_size,
        render_size=cfg.render_size,
        render_backend="gpu" if torch.cuda.is_available() else "cpu",
    )


@register_env("maniskill", validate=validate_maniskill, action_dim=panda_action_dim,
              episode_steps=lambda cfg: cfg.max_episode_steps or default_max_episode_steps(cfg.task),
              obs_keys=maniskill_obs_keys)
def make_maniskill(cfg, num_envs: int, num_procs: int):
    """Build a ManiSkill VecEnv from an :class:`~embodied.config.EnvConfig`."""
    cuda = torch.cuda.is_available()
    sim_backend = cfg.sim_backend if cfg.sim_backend != "auto" else ("physx_cuda" if cuda else "physx_cpu")
    spec = maniskill_spec(cfg)
    if sim_backend == "physx_cuda":
        return ManiSkillGPUVecEnv(spec, num_envs)
    return SubprocVecEnv(
        functools.partial(_make_cpu_env, spec), num_envs, num_procs, timeout_s=cfg.timeout_s,
        restart_crashed=cfg.restart_crashed, startup_timeout_s=cfg.startup_timeout_s,
    )


# observation sizes of the tasks INSTRUCTIONS names, read off built envs (pd_joint_delta_pos; other controllers
# differ by a few floats): task -> (state floats with obs_mode=state, state floats with obs_mode=rgb, cameras)
OBS_SIZES = {"PushCube-v1": (35, 25, 1), "PickCube-v1": (42, 29, 1), "StackCube-v1": (48, 25, 2),
             "PullCube-v1": (35, 28, 1)}
# other tasks: an upper bound of the state (ManiSkill's tabletop tasks observe under 100 floats) and an assumed
# camera count (2: a base and a hand camera)
UNKNOWN_OBS_SIZES = (512, 512, 2)
# host memory (RSS), measured on the CPU simulator: a process stepping envs ~0.55 GiB (state) / ~0.8 GiB (rgb, 64
# px); envs stepped in the env worker itself ~0.3 GiB of SAPIEN there plus ~2 MiB each. The GPU simulator keeps
# its scenes in GPU memory (not counted here) and ~1 GiB of host memory in the worker
PROCESS_BYTES = {"state": int(0.55 * GiB), "rgb": int(0.8 * GiB)}
IN_WORKER_BYTES = {"state": int(0.3 * GiB), "rgb": int(0.55 * GiB)}  # rgb: an estimate (renderer)
PER_ENV_BYTES = 2 * 2**20
GPU_SIM_BYTES = 1 * GiB


def maniskill_obs_spec(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """The observations of :func:`maniskill_obs_keys` with sizes: the table's for the tasks it has, else an upper
    bound of the state and two cameras (:data:`UNKNOWN_OBS_SIZES`)."""
    state_dim, rgb_state_dim, cameras = OBS_SIZES.get(cfg.task, UNKNOWN_OBS_SIZES)
    if cfg.obs_mode != "rgb":
        return {"state": ((state_dim,), "float32")}
    return {"rgb": ((cfg.image_size, cfg.image_size, 3 * cameras), "uint8"), "state": ((rgb_state_dim,), "float32"),
            "instruction": ((instruction_width([instruction_for(cfg.task)]),), "uint8")}


def maniskill_memory(cfg, num_envs: int, num_procs: int) -> EnvMemory:
    sim_backend = cfg.sim_backend if cfg.sim_backend != "auto" else (
        "physx_cuda" if torch.cuda.is_available() else "physx_cpu")
    if sim_backend == "physx_cuda":
        return EnvMemory(0, 0, GPU_SIM_BYTES, "the GPU simulator: its scenes are in GPU memory (not counted)")
    each = PROCESS_BYTES.get(cfg.obs_mode, PROCESS_BYTES["rgb"])
    if num_procs == 0:
        base = IN_WORKER_BYTES.get(cfg.obs_mode, IN_WORKER_BYTES["rgb"])
        return EnvMemory(0, 0, base + num_envs * PER_ENV_BYTES, "stepped in the env worker, measured")
    procs = min(num_procs, num_envs)
    return EnvMemory(procs, each + -(-num_envs // procs) * PER_ENV_BYTES, IN_WORKER_BYTES["state"],
                     f"{procs} sim process(es), ~{each / GiB:.2f} GiB each, measured")


register_env_resources("maniskill", obs_spec=maniskill_obs_spec, memory=maniskill_memory)
