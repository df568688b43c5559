"""Env backends registered by name: ``@register_env("maniskill")``.

A backend is a function ``make(env_cfg, num_envs, num_procs)``
returning a :class:`~envs.base.VecEnv`. Backends register when their module is
imported; :func:`make_vec_env` imports them lazily so that, say, LIBERO's heavy
imports are paid only by runs that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from envs.common import Registry, UserError
from envs.seeds import PROTOCOL_LIMIT, RunSeeds

DEFAULT_EVAL_EPISODES = 100  # eval.episodes=null on a single-task env (ManiSkill's protocol)
ENV_BACKENDS: dict[str, Callable] = {}
ENV_VALIDATORS: dict[str, Callable] = {}


class SeedScheme:
    """How a backend names episodes with seeds; the default suits procedurally generated tasks
    (ManiSkill), where any integer seed is a fresh initial state of the one task.

    A backend with a fixed set of stored initial states (LIBERO) overrides these to map
    seeds onto (task, init state) pairs.
    """

    def train_seed(self, env_cfg, drawn: int, slot: int) -> int:
        """This backend's seed for episode slot ``slot`` (an env, or a GRPO group) of a training
        reset or a validation, from ``drawn``, the slot's seed in its stream (envs/seeds.py)."""
        return drawn

    def eval_seeds(self, env_cfg, eval_cfg) -> list[int]:
        """The evaluation protocol's episodes, each run exactly once, in order."""
        if eval_cfg.tasks is not None:
            raise UserError(f"eval.tasks={list(eval_cfg.tasks)} picks tasks of a suite, but env.task="
                            f"{env_cfg.task!r} is a single task: leave eval.tasks null (eval.episodes "
                            "sets how many episodes it runs).")
        episodes = DEFAULT_EVAL_EPISODES if eval_cfg.episodes is None else eval_cfg.episodes
        if not 0 <= eval_cfg.seed <= PROTOCOL_LIMIT - episodes:
            raise UserError(f"eval.seed={eval_cfg.seed} with eval.episodes={episodes} leaves the "
                            f"seeds [0, 2^31) that evaluations own (above them are training's and "
                            "validation's, envs/seeds.py): pick an eval.seed in "
                            f"[0, {PROTOCOL_LIMIT - episodes}].")
        return [eval_cfg.seed + k for k in range(episodes)]

    def task_of(self, env_cfg, seed: int) -> tuple[int, str]:
        """(task index, task name) of the episode ``seed`` (for per-task tables)."""
        return 0, env_cfg.task


def suite_eval_seeds(tasks: list[int], trials_per_task: int, episodes: int | None,
                     episode_seed: Callable[[int, int], int], suite: str) -> list[int]:
    """A suite's evaluation episodes, task by task: trials 0 .. ``trials_per_task`` - 1 of each of ``tasks``
    (the published protocol). ``episodes`` (``eval.episodes``) set: exactly that many of them, taken trial by
    trial across the tasks (trial 0 of every task, then trial 1, ...) so that every task gets its share;
    still run task by task."""
    protocol = len(tasks) * trials_per_task
    if episodes is None:
        episodes = protocol
    if episodes > protocol:
        raise UserError(f"eval.episodes={episodes}: {suite} evaluates {trials_per_task} trials of each of "
                        f"{len(tasks)} tasks, {protocol} episodes. Set eval.episodes={protocol} or fewer (or null "
                        "for all), or raise eval.trials_per_task.")
    trial_by_trial = [(task, trial) for trial in range(trials_per_task) for task in tasks][:episodes]
    return [episode_seed(task, trial) for task, trial in sorted(trial_by_trial)]


def task_subset(tasks, suite: str, num_tasks: int) -> list[int]:
    """``eval.tasks`` sorted and deduplicated; an index outside the suite's ``num_tasks`` is a UserError."""
    outside = [t for t in tasks if not 0 <= t < num_tasks]
    if outside or not tasks:
        raise UserError(f"eval.tasks={list(tasks)}: {suite} has tasks 0..{num_tasks - 1}; list some of "
                        "those (e.g. eval.tasks=[0,3]) or set eval.tasks=null for the whole suite.")
    return sorted(set(tasks))


ENV_SEED_SCHEMES: dict[str, SeedScheme] = {}
ENV_ACTION_DIMS: dict[str, Callable] = {}  # backend -> action_dim(env_cfg), known without building the env
ENV_EPISODE_STEPS: dict[str, Callable] = {}  # backend -> max_episode_steps(env_cfg), the same
# backend -> obs_keys(env_cfg): {observation key: its shape, or None where only a built env knows it}
ENV_OBS_KEYS: dict[str, Callable] = {}
ENV_RENDER_PROBLEMS: dict[str, Callable] = {}  # backend -> render_problem(env_cfg): why no video frames, or None
# backend -> versions(env_cfg): {package: version} its env processes compute with, where they run another interpreter
ENV_VERSIONS: dict[str, Callable] = {}

# backend name -> module that registers it
_BACKEND_MODULES = Registry("env backend (env.backend)")
_BACKEND_MODULES.update({"maniskill": "envs.maniskill", "libero": "envs.libero", "gym": "envs.gym_env",
                         "metaworld": "envs.metaworld", "free": "envs.free_env"})


def register_env(name: str, validate: Callable | None = None, seeds: SeedScheme | None = None,
                 action_dim: Callable | None = None, episode_steps: Callable | None = None,
                 obs_keys: Callable | None = None, render_problem: Callable | None = None,
                 versions: Callable | None = None) -> Callable:
    """Register a backend; ``validate(env_cfg)`` raises UserError for bad names before any sim
    starts; ``seeds`` says how its episodes are named by seeds (default :class:`SeedScheme`);
    ``action_dim(env_cfg)``, ``episode_steps(env_cfg)`` and ``obs_keys(env_cfg)`` are the action
    size, the episode's step limit and the observation keys (with the shapes known) where they are
    known without building an env (else None); ``render_problem(env_cfg)`` why its envs cannot give video
    frames, or None (checked before workers start when videos are to be recorded); ``versions(env_cfg)`` the
    package versions of the interpreter its env processes run, where that is not this one (provenance)."""

    def decorator(fn: Callable) -> Callable:
        ENV_BACKENDS[name] = fn
        ENV_SEED_SCHEMES[name] = seeds or SeedScheme()
        if action_dim is not None:
            ENV_ACTION_DIMS[name] = action_dim
        if episode_steps is not None:
            ENV_EPISODE_STEPS[name] = episode_steps
        if obs_keys is not None:
            ENV_OBS_KEYS[name] = obs_keys
        if render_problem is not None:
            ENV_RENDER_PROBLEMS[name] = render_problem
        if versions is not None:
            ENV_VERSIONS[name] = versions
        if validate is not None:
            ENV_VALIDATORS[name] = validate
        return fn

    return decorator


@dataclass(frozen=True)
class EnvMemory:
    """The host memory one env worker's envs take: ``processes`` sim processes of ``bytes_each``, plus
    ``in_worker`` bytes in the env worker itself (envs it steps without a process of their own). Rough
    figures (RSS) measured per backend, named in ``basis``: what :mod:`embodied.memory_plan` adds up."""

    processes: int
    bytes_each: int
    in_worker: int = 0
    basis: str = ""

    @property
    def total(self) -> int:
        return self.processes * self.bytes_each + self.in_worker


GiB = 2**30
# backend -> obs_spec(env_cfg): {key: (shape, dtype name)} of every observation, without building an env (an
# upper bound where only a built env knows a size exactly: the backend's function says which); the replay buffer's
# size in the memory plan comes from it
ENV_STATIC_OBS_SPECS: dict[str, Callable] = {}
# backend -> memory(env_cfg, num_envs, num_procs) -> EnvMemory: what ``num_envs`` envs over ``num_procs`` processes
# (one env worker's share) take in host memory
ENV_MEMORY: dict[str, Callable] = {}


def register_env_resources(name: str, obs_spec: Callable, memory: Callable) -> None:
    """What backend ``name`` needs, known before any env starts: ``obs_spec(env_cfg)`` (every observation's shape
    and dtype name) and ``memory(env_cfg, num_envs, num_procs)`` (an :class:`EnvMemory`); the memory plan reads both
    (embodied/memory_plan.py)."""
    ENV_STATIC_OBS_SPECS[name] = obs_spec
    ENV_MEMORY[name] = memory


def env_static_obs_spec(env_cfg) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """The env's observations as ``{key: (shape, dtype name)}`` before any env starts, or None where the
    backend cannot say."""
    _load_backend(env_cfg)
    known = ENV_STATIC_OBS_SPECS.get(env_cfg.backend)
    return known(env_cfg) if known else None


def env_memory(env_cfg, num_envs: int, num_procs: int) -> EnvMemory | None:
    """Host memory of one env worker's ``num_envs`` envs over ``num_procs`` processes, or None where the
    backend cannot say."""
    _load_backend(env_cfg)
    known = ENV_MEMORY.get(env_cfg.backend)
    return known(env_cfg, num_envs, num_procs) if known else None


def _load_backend(env_cfg) -> None:
    importlib.import_module(_BACKEND_MODULES.get(env_cfg.backend))


def check_env_config(env_cfg) -> None:
    """Raise a UserError if ``env_cfg`` names an unknown backend or task."""
    _load_backend(env_cfg)
    if env_cfg.backend in ENV_VALIDATORS:
        ENV_VALIDATORS[env_cfg.backend](env_cfg)


def env_action_dim(env_cfg) -> int | None:
    """The env's action size before any env starts (None where only a built env knows it), so a
    policy checkpoint of another action size fails before workers start."""
    _load_backend(env_cfg)
    known = ENV_ACTION_DIMS.get(env_cfg.backend)
    return known(env_cfg) if known else None


def env_episode_steps(env_cfg) -> int | None:
    """The env's episode step limit (simulator steps) before any env starts, or None."""
    _load_backend(env_cfg)
    known = ENV_EPISODE_STEPS.get(env_cfg.backend)
    return known(env_cfg) if known else None


def env_obs_keys(env_cfg) -> dict[str, tuple[int, ...] | None] | None:
    """The env's observation keys before any env starts, each with its shape where that is known
    without building it (None: only a built env knows), so a policy that needs a camera or a state
    the env lacks fails before Ray starts. None where the backend cannot say."""
    _load_backend(env_cfg)
    known = ENV_OBS_KEYS.get(env_cfg.backend)
    return known(env_cfg) if known else None


def env_render_problem(env_cfg) -> str | None:
    """Why the env cannot give video frames (one sentence), or None where it can or the backend cannot say."""
    _load_backend(env_cfg)
    known = ENV_RENDER_PROBLEMS.get(env_cfg.backend)
    return known(env_cfg) if known else None


def env_versions(env_cfg) -> dict[str, str]:
    """The package versions the env processes compute with where they run another interpreter, else {}."""
    _load_backend(env_cfg)
    known = ENV_VERSIONS.get(env_cfg.backend)
    return known(env_cfg) if known else {}


def seed_scheme(env_cfg) -> SeedScheme:
    _load_backend(env_cfg)
    return ENV_SEED_SCHEMES[env_cfg.backend]


def make_vec_env(env_cfg, num_envs: int | None = None, num_procs: int | None = None):
    """Build the VecEnv that ``env_cfg`` describes.

    ``num_envs`` / ``num_procs`` default to ``env_cfg.num_envs`` / ``env_cfg.num_procs``.
    """
    check_env_config(env_cfg)
    return ENV_BACKENDS[env_cfg.backend](
        env_cfg,
        num_envs=env_cfg.num_envs if num_envs is None else num_envs,
        num_procs=env_cfg.num_procs if num_procs is None else num_procs,
    )


def training_reset_seeds(env_cfg, run: RunSeeds, iteration: int, num_envs: int, group_size: int = 1) -> list[int]:
    """The seed of each of ``num_envs`` envs reset for training at ``iteration``: env ``j`` starts
    episode slot ``j // group_size`` of the training-reset stream, so the envs of a GRPO group
    share an initial state and no two iterations share one (envs/seeds.py)."""
    scheme, stream, slots = seed_scheme(env_cfg), run.train_resets, num_envs // group_size
    return [scheme.train_seed(env_cfg, stream.seed(iteration * slots + j // group_size), j // group_size)
            for j in range(num_envs)]


def validation_seeds(env_cfg, run: RunSeeds, episodes: int) -> list[int]:
    """The periodic validations' episodes: the run's validation stream, never an evaluation's or
    training's seeds (on LIBERO: the stored init states, like everything there)."""
    scheme, stream = seed_scheme(env_cfg), run.validation
    return [scheme.train_seed(env_cfg, stream.seed(k), k) for k in range(episodes)]
