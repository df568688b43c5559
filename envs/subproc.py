"""Process-parallel vectorization of single (CPU) simulator envs.

Each worker process owns a contiguous slice of the batch and steps its envs one
after the other; observations, rewards and flags travel through shared memory,
and only a one-word command crosses the pipe per step. Batching several envs per
process is what makes this fast: per-step IPC is paid once per process, not once
per env (gymnasium's AsyncVectorEnv pays it per env).

``step(actions, observe=False)`` lets an env skip building observations nobody will
read (the inner steps of an action chunk): a camera render costs far more than the
physics step on CPU. Envs whose episode ends still report their final observation.

``num_procs=0`` steps the whole batch in the calling process (useful inside a Ray
worker that is already its own process).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import numpy as np
import torch

from envs.base import EpisodeTracker, Obs, StepResult
from envs.seeds import AutoResets


class SingleEnv(Protocol):
    """One simulator instance with numpy I/O (what a backend adapts to)."""

    obs_spec: dict[str, tuple[tuple[int, ...], np.dtype]]
    action_dim: int
    max_episode_steps: int

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        """Start the episode ``seed`` names; ``reconfigure``: rebuild the scene first, so that
        nothing earlier episodes left in the simulator shapes this one (evaluation resets)."""
        ...

    def step(self, action: np.ndarray, observe: bool = True) -> tuple[dict[str, np.ndarray] | None, float, bool,
                                                                     bool, bool]:
        """-> (obs, reward, terminated, truncated, success). With ``observe=False`` an env may
        return ``obs=None`` and skip building it; it must then implement :meth:`observe`."""
        ...

    def observe(self) -> dict[str, np.ndarray]:
        """The current observation (after a step that returned ``obs=None``)."""
        ...

    def render(self) -> np.ndarray: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ResetRequest:
    """A reset of a slice of envs, as sent to a worker process."""

    seeds: list[int | None]
    reconfigure: bool = False
    auto_resets: AutoResets | None = None

    def slice(self, start: int, stop: int, reconfigure: bool | None = None) -> ResetRequest:
        auto = self.auto_resets.shifted(start) if self.auto_resets else None
        return ResetRequest(self.seeds[start:stop], self.reconfigure if reconfigure is None else reconfigure, auto)


class EnvCrashedError(RuntimeError):
    """An env worker process died, raised, or stopped answering."""


def _buffer_specs(obs_spec: dict, num_envs: int, action_dim: int) -> dict:
    """Name -> (shape, dtype) of every array exchanged with the workers."""
    specs = {}
    for key, (shape, dtype) in obs_spec.items():
        specs[f"obs/{key}"] = ((num_envs, *shape), np.dtype(dtype))
        specs[f"final_obs/{key}"] = ((num_envs, *shape), np.dtype(dtype))
    specs["action"] = ((num_envs, action_dim), np.dtype(np.float32))
    specs["reward"] = ((num_envs,), np.dtype(np.float32))
    for flag in ("terminated", "truncated", "success"):
        specs[flag] = ((num_envs,), np.dtype(np.bool_))
    return specs


class EnvBatch:
    """Steps a list of :class:`SingleEnv` with auto-reset, writing into numpy buffers."""

    def __init__(self, envs: list[SingleEnv], buffers: dict[str, np.ndarray]):
        self.envs = envs
        self.buf = buffers
        # evaluation runs fixed-length episodes: success does not end them
        self.ignore_terminations = False
        self.seeds: list[int | None] = [None] * len(envs)  # each env's last reset() seed
        self.steps_since_reset = [0] * len(envs)  # simulator steps
        self.auto_resets: AutoResets | None = None

    def _write_obs(self, prefix: str, i: int, obs: dict[str, np.ndarray]) -> None:
        for key, value in obs.items():
            self.buf[f"{prefix}/{key}"][i] = value

    def reset(self, request: ResetRequest) -> None:
        self.auto_resets = request.auto_resets
        for i, (env, seed) in enumerate(zip(self.envs, request.seeds, strict=True)):
            self.seeds[i], self.steps_since_reset[i] = seed, 0
            self._write_obs("obs", i, env.reset(seed, reconfigure=request.reconfigure))
        if request.reconfigure:
            gc.collect()  # the scenes just torn down, all at once (ManiSkill's teardown would collect per env)

    def _auto_reset_seed(self, i: int) -> int | None:
        """Seed of env ``i``'s next episode from the auto-reset stream (envs/seeds.py): the
        run's, or without one a stream of the env's reset seed (seeded use repeats exactly;
        ManiSkill's unseeded resets would draw fresh entropy). An env with an
        ``auto_reset_seed(last_seed, drawn)`` method maps the drawn seed onto its own
        (LIBERO: same task, another stored init state)."""
        if self.seeds[i] is None:
            return None
        auto = self.auto_resets or AutoResets.after(self.seeds[i])
        drawn = auto.seed(i if self.auto_resets else 0, self.steps_since_reset[i])
        own_scheme = getattr(self.envs[i], "auto_reset_seed", None)
        return own_scheme(self.seeds[i], drawn) if own_scheme else drawn

    def step(self, observe: bool = True) -> None:
        """Step every env; ``observe=False``: the ``obs`` buffers are left as they were, except
        for envs whose episode ended (final and reset observations are always written)."""
        actions = self.buf["action"]
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, success = env.step(actions[i], observe)
            self.steps_since_reset[i] += 1
            terminated = terminated and not self.ignore_terminations
            self.buf["reward"][i] = reward
            self.buf["terminated"][i] = terminated
            self.buf["truncated"][i] = truncated
            self.buf["success"][i] = success
            if terminated or truncated:
                self._write_obs("final_obs", i, env.observe() if obs is None else obs)
                obs = env.reset(self._auto_reset_seed(i))
            if obs is not None:
                self._write_obs("obs", i, obs)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _worker_main(pipe, make_env, env_ids, shm_names, specs, start, stop):
    """Worker process: attach to shared memory, then serve commands until 'close'."""
    blocks = {name: shared_memory.SharedMemory(name=shm) for name, shm in shm_names.items()}
    try:
        buffers = {
            name: np.ndarray(specs[name][0], specs[name][1], buffer=blocks[name].buf)[start:stop]
            for name in specs
        }
        batch = EnvBatch([make_env(i) for i in env_ids], buffers)
        pipe.send(("ok", None))
        while True:
            cmd, arg = pipe.recv()
            if cmd == "step":
                batch.step(arg)
                pipe.send(("ok", None))
            elif cmd == "reset":
                batch.reset(arg)
                pipe.send(("ok", None))
            elif cmd == "ignore_terminations":
                batch.ignore_terminations = arg
                pipe.send(("ok", None))
            elif cmd == "render":
                pipe.send(("ok", batch.envs[arg].render()))
            elif cmd == "close":
                batch.close()
                pipe.send(("ok", None))
                return
    except (KeyboardInterrupt, EOFError):
        return
    except Exception:  # report, then die: the parent raises EnvCrashedError with this text
        pipe.send(("error", traceback.format_exc()))
    finally:
        for block in blocks.values():
            block.close()


class SubprocVecEnv:
    """A :class:`~envs.base.VecEnv` over ``num_envs`` single envs in ``num_procs`` processes.

    Args:
        make_env: picklable ``make_env(env_index) -> SingleEnv``.
        num_envs: batch size ``B``.
        num_procs: worker processes (0 = step in this process).
        timeout_s: how long a worker may take to answer one command.
        restart_crashed: a worker process that dies, raises or hangs during ``step`` is
            replaced by a fresh one: its envs' episodes end as failed-by-error
            (``info["error"]``) and restart from their last reset seeds, and the batch
            goes on. Without it the failure raises :class:`EnvCrashedError`.
    """

    def __init__(
        self,
        make_env: Callable[[int], SingleEnv],
        num_envs: int,
        num_procs: int,
        timeout_s: float = 120.0,
        restart_crashed: bool = False,
    ):
        if num_procs > num_envs:
            num_procs = num_envs
        self.num_envs = num_envs
        self.timeout_s = timeout_s
        self.restart_crashed = restart_crashed
        self._make_env = make_env
        self._last_reset = ResetRequest([None] * num_envs)  # replayed on a restarted worker
        self._ignore_terminations = False
        self.restarts = 0  # worker processes replaced so far
        self._startup_s = max(timeout_s, 300.0)  # building envs can take far longer than a step
        self.device = torch.device("cpu")
        # one env built here tells the shapes the shared buffers need
        first = make_env(0)
        self.obs_spec_np = dict(first.obs_spec)
        self.action_dim = first.action_dim
        self.max_episode_steps = first.max_episode_steps
        self.obs_spec = {k: (s, _torch_dtype(d)) for k, (s, d) in self.obs_spec_np.items()}
        if num_procs > 0:
            first.close()
        self._specs = _buffer_specs(self.obs_spec_np, num_envs, self.action_dim)
        self._procs: list = []
        self._pipes: list = []
        self._blocks: dict = {}
        if num_procs == 0:
            self.buf = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self._specs.items()}
            self._local = EnvBatch([first] + [make_env(i) for i in range(1, num_envs)], self.buf)
        else:
            self._local = None
            self._start_workers(make_env, num_procs)
        self.tracker = EpisodeTracker(num_envs)

    # -- process management -------------------------------------------------------
    def _start_workers(self, make_env, num_procs: int) -> None:
        self.buf = {}
        for name, (shape, dtype) in self._specs.items():
            nbytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
            block = shared_memory.SharedMemory(create=True, size=nbytes)
            self._blocks[name] = block
            self.buf[name] = np.ndarray(shape, dtype, buffer=block.buf)
        self._shm_names = {name: block.name for name, block in self._blocks.items()}
        bounds = np.linspace(0, self.num_envs, num_procs + 1).astype(int)
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            proc, pipe = self._spawn(start, stop)
            self._procs.append(proc)
            self._pipes.append(pipe)
        self._gather(self._startup_s)

    def _spawn(self, start: int, stop: int):
        # fork deadlocks inside lavapipe once the parent has built an env (docs/architecture.md, "Measured facts")
        ctx = mp.get_context("forkserver")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main,
            args=(child, self._make_env, list(range(start, stop)), self._shm_names, self._specs, start, stop),
            daemon=True,
        )
        proc.start()
        child.close()
        return proc, parent

    def _restart(self, rank: int) -> None:
        """Replace worker ``rank`` by a fresh process and reset its envs to their last seeds."""
        proc = self._procs[rank]
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
        self._pipes[rank].close()
        start, stop = self._slices()[rank]
        self._procs[rank], self._pipes[rank] = self._spawn(start, stop)
        self.restarts += 1
        self._answer(rank, self._startup_s)  # ready
        replay = self._last_reset.slice(start, stop, reconfigure=False)  # a fresh process: nothing to clear
        for command in (("ignore_terminations", self._ignore_terminations), ("reset", replay)):
            self._pipes[rank].send(command)
            self._answer(rank, self._startup_s)

    def _gather(self, timeout_s: float | None = None, restart: bool = False) -> tuple[list, list[int]]:
        """Wait for every worker's answer; raise EnvCrashedError on death, error or timeout,
        or (``restart``) replace the failed workers. Returns (answers, restarted ranks)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        answers, restarted = [], []
        for rank in range(len(self._pipes)):
            try:
                answers.append(self._answer(rank, timeout_s))
            except EnvCrashedError:
                if not restart:
                    self.close(force=True)
                    raise
                self._restart(rank)
                answers.append(None)
                restarted.append(rank)
        return answers, restarted

    def _answer(self, rank: int, timeout_s: float):
        """Worker ``rank``'s answer to the last command; EnvCrashedError if it has none."""
        pipe = self._pipes[rank]
        if not pipe.poll(timeout_s):
            alive = self._procs[rank].is_alive()
            raise EnvCrashedError(
                f"Env worker process {rank} did not answer within {timeout_s:.0f} s "
                f"({'still running: the simulator hangs' if alive else 'it died'}). "
                "Check the simulator on its own with `embodied check-render`, lower "
                "env.num_envs, or raise env.timeout_s if steps are legitimately slow."
            )
        try:
            status, payload = pipe.recv()
        except (EOFError, OSError):
            self._procs[rank].join(timeout=1)
            code = self._procs[rank].exitcode
            raise EnvCrashedError(
                f"Env worker process {rank} died (exit code {code}). A negative code is the "
                "signal that killed it (-9: out of memory or killed, -11: crash in the "
                "simulator). Lower env.num_envs or check the simulator with "
                "`embodied check-render`."
            ) from None
        if status == "error":
            raise EnvCrashedError(f"Env worker process {rank} raised:\n{payload}")
        return payload

    def _broadcast(self, cmd: str, per_rank_args: list | None = None, restart: bool = False):
        for rank, pipe in enumerate(self._pipes):
            try:
                pipe.send((cmd, None if per_rank_args is None else per_rank_args[rank]))
            except OSError:
                pass  # the worker is gone: _gather reports how it died
        return self._gather(restart=restart)

    def _slices(self) -> list[tuple[int, int]]:
        bounds = np.linspace(0, self.num_envs, len(self._pipes) + 1).astype(int)
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    # -- VecEnv API ------------------------------------------------------------
    def reset(self, seed: int | list[int] | None = None, reconfigure: bool = False,
              auto_resets: AutoResets | None = None) -> tuple[Obs, dict]:
        """Reset every env. ``seed``: int (env ``i`` gets ``seed + i``), a list, or None;
        ``reconfigure``: rebuild the scenes first; ``auto_resets``: where the episodes the
        envs start by themselves get their seeds (None: from each env's reset seed)."""
        if isinstance(seed, int):
            seeds = [seed + i for i in range(self.num_envs)]
        elif seed is None:
            seeds = [None] * self.num_envs
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"reset got {len(seeds)} seeds for {self.num_envs} envs")
        self._last_reset = ResetRequest(seeds, reconfigure, auto_resets)
        if self._local is not None:
            self._local.reset(self._last_reset)
        else:
            self._broadcast("reset", [self._last_reset.slice(a, b) for a, b in self._slices()])
        self.tracker.reset()
        return self._obs("obs"), {}

    def step(self, actions: torch.Tensor, observe: bool = True) -> StepResult:
        """Step all envs with ``actions`` float ``[B, A]``. With ``observe=False`` the result's
        ``obs`` is empty (``{}``): envs skip the observations nobody reads; ``final_obs``
        of episodes that ended is still there."""
        self.buf["action"][:] = actions.detach().cpu().numpy()
        error = torch.zeros(self.num_envs, dtype=torch.bool)
        if self._local is not None:
            self._local.step(observe)
        else:
            # the last good observations: what a failed episode ends on
            before = {k: self.buf[f"obs/{k}"].copy() for k in self.obs_spec} if self.restart_crashed else None
            _, restarted = self._broadcast("step", [observe] * len(self._pipes), restart=self.restart_crashed)
            for rank in restarted:
                error[slice(*self._slices()[rank])] = True
            self._end_failed_episodes(error, before)
        reward = torch.from_numpy(self.buf["reward"].copy())
        terminated = torch.from_numpy(self.buf["terminated"].copy())
        truncated = torch.from_numpy(self.buf["truncated"].copy())
        success = torch.from_numpy(self.buf["success"].copy())
        done = terminated | truncated
        info = {
            "success": success,
            "error": error,
            "final_obs": self._obs("final_obs"),
            "episode": self.tracker.update(reward, success, done),
        }
        return StepResult(self._obs("obs") if observe else {}, reward, terminated, truncated, info)

    def _end_failed_episodes(self, error: torch.Tensor, before: dict | None) -> None:
        """Envs of a replaced worker: their episodes end now, truncated and unsuccessful, on
        their last good observation; the restart already reset them for the next one."""
        idx = error.nonzero().flatten().numpy()
        if len(idx) == 0:
            return
        self.buf["reward"][idx] = 0.0
        self.buf["terminated"][idx] = False
        self.buf["truncated"][idx] = True
        self.buf["success"][idx] = False
        for key in self.obs_spec:
            self.buf[f"final_obs/{key}"][idx] = before[key][idx]

    def set_ignore_terminations(self, flag: bool) -> None:
        """With True, episodes end only at the time limit (evaluation protocol)."""
        self._ignore_terminations = flag
        if self._local is not None:
            self._local.ignore_terminations = flag
        else:
            self._broadcast("ignore_terminations", [flag] * len(self._pipes))

    def render(self, env_index: int = 0) -> np.ndarray:
        """RGB frame ``[H, W, 3]`` uint8 of one env (needs render support in the backend)."""
        if self._local is not None:
            return self._local.envs[env_index].render()
        for rank, (a, b) in enumerate(self._slices()):
            if a <= env_index < b:
                self._pipes[rank].send(("render", env_index - a))
                status, payload = self._pipes[rank].recv()
                if status == "error":
                    raise EnvCrashedError(f"Env worker process {rank} raised:\n{payload}")
                return payload
        raise IndexError(env_index)

    def _obs(self, prefix: str) -> Obs:
        return {k: torch.from_numpy(self.buf[f"{prefix}/{k}"].copy()) for k in self.obs_spec}

    def close(self, force: bool = False) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        for pipe, proc in zip(self._pipes, self._procs, strict=True):
            try:
                if not force and proc.is_alive():
                    pipe.send(("close", None))
                    pipe.poll(10)
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=5 if not force else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._pipes, self._procs = [], []
        for block in self._blocks.values():
            block.close()
            block.unlink()
        self._blocks = {}

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:
            pass


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=dtype)).dtype
