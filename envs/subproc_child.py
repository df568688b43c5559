"""What runs inside an env process of :class:`~envs.subproc.SubprocVecEnv`: the batch of single
envs it steps (:class:`EnvBatch`, also what ``num_procs=0`` steps in the calling process) and the
command loop (:func:`serve`).

The protocol, one command at a time over the process's pipe: the parent sends ``(command, arg)``
and the process answers every command with exactly one reply, ``("ok", result)``; a command it
does not know with ``("refused", text naming it)``, at once, and it goes on serving; an error in
the simulator with ``("error", traceback)``, after which it exits. Bulk data (actions,
observations, rewards, flags) travels through shared memory, not the pipe.

This module imports numpy and no torch: an env process loads only what its simulator needs.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

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
class EnvShape:
    """What the shared buffers of a batch need to know of its envs, for a backend that tells it without
    building one in the parent (whose interpreter may not be able to: envs/launch.py)."""

    obs_spec: dict[str, tuple[tuple[int, ...], np.dtype]]
    action_dim: int
    max_episode_steps: int


@dataclass(frozen=True)
class ResetRequest:
    """A reset of a slice of envs, as sent to a worker process."""

    seeds: list[int | None]
    reconfigure: bool = False
    auto_resets: AutoResets | None = None

    def slice(self, start: int, stop: int, reconfigure: bool | None = None) -> ResetRequest:
        auto = self.auto_resets.shifted(start) if self.auto_resets else None
        return ResetRequest(self.seeds[start:stop], self.reconfigure if reconfigure is None else reconfigure, auto)


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

    def set_ignore_terminations(self, flag: bool) -> None:
        self.ignore_terminations = flag

    def render(self, index: int) -> np.ndarray:
        return self.envs[index].render()

    def close(self) -> None:
        for env in self.envs:
            env.close()


def serve(pipe: Connection, make_env: Callable[[int], SingleEnv], env_ids: list[int], shm_names: dict[str, str],
          specs: dict, start: int, stop: int, untrack_shared_memory: bool = False) -> None:
    """An env process's main: attach to shared memory, build the envs, then answer commands
    (the module docstring's protocol) until ``close``. ``untrack_shared_memory``: a process with a
    resource tracker of its own (another interpreter's) keeps it from unlinking the parent's blocks."""
    blocks = {name: shared_memory.SharedMemory(name=shm) for name, shm in shm_names.items()}
    if untrack_shared_memory:
        for block in blocks.values():
            resource_tracker.unregister(block._name, "shared_memory")  # Python < 3.13 has no track=False
    try:
        buffers = {
            name: np.ndarray(specs[name][0], specs[name][1], buffer=blocks[name].buf)[start:stop]
            for name in specs
        }
        batch = EnvBatch([make_env(i) for i in env_ids], buffers)
        commands: dict[str, Callable[[Any], Any]] = {
            "step": batch.step, "reset": batch.reset, "ignore_terminations": batch.set_ignore_terminations,
            "render": batch.render, "close": lambda _: batch.close(),
        }
        pipe.send(("ok", None))  # ready
        while True:
            message = pipe.recv()
            cmd, arg = message if isinstance(message, tuple) and len(message) == 2 else (message, None)
            run = commands.get(cmd) if isinstance(cmd, str) else None
            if run is None:
                # the caller's mistake, not the simulator's: say so now rather than stay silent
                # until the parent's deadline reports a hang; the envs are untouched, so serve on
                pipe.send(("refused", f"unknown command {cmd!r} (known: {', '.join(commands)})"))
                continue
            pipe.send(("ok", run(arg)))
            if cmd == "close":
                return
    except (KeyboardInterrupt, EOFError):  # the parent is gone: nobody to answer
        return
    except Exception:  # report, then die: the parent raises EnvCrashedError with this text
        pipe.send(("error", traceback.format_exc()))
    finally:
        for block in blocks.values():
            block.close()
