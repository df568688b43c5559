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

What runs inside an env process, and the command protocol, is envs/subproc_child.py; how each
way a process can fail is reported or recovered is :class:`SubprocVecEnv`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing import shared_memory
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch

from envs.base import EpisodeTracker, Obs, StepResult
from envs.launch import start_env_process
from envs.seeds import AutoResets
from envs.subproc_child import EnvBatch, EnvShape, ResetRequest, SingleEnv

__all__ = ["EnvCommandError", "EnvCrashedError", "EnvShape", "ResetRequest", "SingleEnv", "SubprocVecEnv"]


class EnvCrashedError(RuntimeError):
    """An env worker process died, raised, or stopped answering."""


class EnvCommandError(RuntimeError):
    """An env process refused a command it does not know: a bug in the caller, not a crash (the
    process is fine and serves on, so it is never restarted for it)."""


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


class SubprocVecEnv:
    """A :class:`~envs.base.VecEnv` over ``num_envs`` single envs in ``num_procs`` processes.

    Args:
        make_env: picklable ``make_env(env_index) -> SingleEnv``.
        num_envs: batch size ``B``.
        num_procs: worker processes (0 = step in this process).
        timeout_s: how long a worker may take to answer one command (``env.timeout_s``).
        startup_timeout_s: how long a worker may take to build its envs, at start and on a restart
            (``env.startup_timeout_s``; at least ``timeout_s``).
        restart_crashed: replace a failed process and go on (below); without it any failure
            closes the batch and raises :class:`EnvCrashedError`.
        shape: the envs' :class:`EnvShape`; None: one env built here tells it.
        python: the interpreter that runs the env processes (envs/launch.py; needs ``shape`` and
            ``num_procs >= 1``); None: this one's.

    Every command is answered (envs/subproc_child.py) and every wait for an answer has a
    deadline. A process that exits (killed, segfault) is seen at once through its sentinel, not
    at the deadline: :class:`EnvCrashedError` names it, its pid, the command and its exit code;
    one that raises sends its traceback; one silent past ``timeout_s`` hangs. A command the
    process does not know is refused at once (:class:`EnvCommandError`), the process unharmed.

    With ``restart_crashed`` a failed process is replaced by a fresh one whose envs restart from
    their last reset seeds (and the current ``set_ignore_terminations`` flag):

    - ``step``: replaced at once; its envs' episodes end failed-by-error in that step's result
      (``info["error"]``; truncated, unsuccessful, ``final_obs`` the last good observation);
    - ``reset``: replaced at once, and the replacement's start *is* the reset (it replays the
      latest request), so reset returns as if nothing had failed: it ends every episode anyway;
    - ``set_ignore_terminations``: the process is stopped, and the next ``step`` or ``reset``
      replaces it as above, so the episodes it lost are reported (by that step);
    - ``render``: the frame is lost with the episode it would show, so it raises
      :class:`EnvCrashedError`; the process is stopped and replaced as after
      ``set_ignore_terminations``.
    """

    def __init__(
        self,
        make_env: Callable[[int], SingleEnv],
        num_envs: int,
        num_procs: int,
        timeout_s: float = 120.0,
        restart_crashed: bool = False,
        startup_timeout_s: float = 300.0,
        shape: EnvShape | None = None,
        python: str | None = None,
    ):
        if python is not None and (shape is None or num_procs < 1):
            raise ValueError("envs run by another interpreter need their EnvShape and num_procs >= 1")
        if num_procs > num_envs:
            num_procs = num_envs
        self.num_envs = num_envs
        self.timeout_s = timeout_s
        self.restart_crashed = restart_crashed
        self._make_env = make_env
        self._python = python
        self._last_reset = ResetRequest([None] * num_envs)  # replayed on a restarted worker
        self._ignore_terminations = False
        self.restarts = 0  # worker processes replaced so far
        self._startup_s = max(timeout_s, startup_timeout_s)  # building envs can take far longer than a step
        self.device = torch.device("cpu")
        # the shapes the shared buffers need: given, or told by one env built here
        first = make_env(0) if shape is None else None
        shape = shape or EnvShape(dict(first.obs_spec), first.action_dim, first.max_episode_steps)
        self.obs_spec_np = dict(shape.obs_spec)
        self.action_dim = shape.action_dim
        self.max_episode_steps = shape.max_episode_steps
        self.obs_spec = {k: (s, _torch_dtype(d)) for k, (s, d) in self.obs_spec_np.items()}
        if num_procs > 0 and first is not None:
            first.close()
        self._specs = _buffer_specs(self.obs_spec_np, num_envs, self.action_dim)
        self._procs: list = []
        self._pipes: list = []
        self._sent: list[str] = []  # each process's last command (what an error names)
        self._blocks: dict = {}
        if num_procs == 0:
            self.buf = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self._specs.items()}
            self._local = EnvBatch([first or make_env(0)] + [make_env(i) for i in range(1, num_envs)], self.buf)
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
            self._sent.append("start")
        self._gather(self._startup_s)

    def _spawn(self, start: int, stop: int):
        args = (self._make_env, list(range(start, stop)), self._shm_names, self._specs, start, stop)
        return start_env_process(args, self._python)

    def _restart(self, rank: int) -> None:
        """Replace worker ``rank`` by a fresh process and reset its envs to their last seeds."""
        proc = self._procs[rank]
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
        self._pipes[rank].close()
        start, stop = self._slices()[rank]
        self._procs[rank], self._pipes[rank] = self._spawn(start, stop)
        self._sent[rank] = "start"
        self.restarts += 1
        self._answer(rank, self._startup_s)  # ready
        replay = self._last_reset.slice(start, stop, reconfigure=False)  # a fresh process: nothing to clear
        for cmd, arg in (("ignore_terminations", self._ignore_terminations), ("reset", replay)):
            self._send(rank, cmd, arg)
            self._answer(rank, self._startup_s)

    def _stop(self, rank: int) -> None:
        """Kill process ``rank`` (a hung one would answer late, and its reply would be read as the
        next command's); the next step or reset finds it dead and replaces it."""
        self._procs[rank].kill()
        self._procs[rank].join(timeout=5)

    def _send(self, rank: int, cmd: str, arg: Any = None) -> None:
        self._sent[rank] = cmd
        try:
            self._pipes[rank].send((cmd, arg))
        except OSError:
            pass  # the process is gone: waiting for its answer reports how it died

    def _gather(self, timeout_s: float | None = None, on_crash: str = "raise") -> tuple[list, list[int]]:
        """Every process's answer to the command just sent. A process that failed: replaced now
        (``on_crash="restart"``), stopped for the next step or reset to replace (``"stop"``),
        or, with ``"raise"`` or without ``restart_crashed``, the batch closes and raises. Every
        process is read before a refusal is raised: no stale answer is left in a pipe.
        Returns (answers, replaced ranks)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        answers, restarted, refused = [], [], []
        for rank in range(len(self._pipes)):
            try:
                answers.append(self._answer(rank, timeout_s))
                continue
            except EnvCommandError as err:
                refused.append(err)
            except EnvCrashedError as err:
                if on_crash == "raise" or not self.restart_crashed:
                    self.close(force=True)
                    raise
                if on_crash == "stop":
                    self._stop(rank)
                else:
                    self._restart_or_raise(rank, err)
                    restarted.append(rank)
            answers.append(None)
        if refused:
            raise refused[0]
        return answers, restarted

    def _restart_or_raise(self, rank: int, failure: EnvCrashedError) -> None:
        try:
            self._restart(rank)
        except EnvCrashedError as err:  # it fails again on its own: replacing it once more would loop
            self.close(force=True)
            raise EnvCrashedError(f"{failure}\nIts replacement failed too, so the batch is closed: {err}") from None

    def _answer(self, rank: int, timeout_s: float) -> Any:
        """Process ``rank``'s answer to its last command: its reply, or EnvCrashedError if it
        died, raised or stayed silent for ``timeout_s``; EnvCommandError if it refused."""
        pipe, proc, cmd = self._pipes[rank], self._procs[rank], self._sent[rank]
        # its sentinel too: a dead process must not wait out the deadline, and a pipe that another
        # process still holds open (a helper the simulator started) would never show EOF
        if not wait([pipe, proc.sentinel], timeout_s):
            slow = ("env.startup_timeout_s if building the envs" if cmd == "start"
                    else "env.timeout_s if steps")
            raise EnvCrashedError(
                f"Env worker process {rank} (pid {proc.pid}) did not answer `{cmd}` within {timeout_s:.0f} s and "
                "is still running: the simulator hangs. Check the simulator on its own with `embodied "
                f"check-render`, lower env.num_envs, or raise {slow} is legitimately slow."
            )
        try:
            if not pipe.poll(0):  # only the sentinel is ready: it exited without a word
                raise EOFError
            status, payload = pipe.recv()
        except (EOFError, OSError):
            proc.join(timeout=1)
            raise EnvCrashedError(
                f"Env worker process {rank} (pid {proc.pid}) died during `{cmd}` (exit code {proc.exitcode}). "
                "A negative code is the signal that killed it (-9: out of memory or killed, -11: crash in "
                "the simulator). Lower env.num_envs or check the simulator with `embodied check-render`."
            ) from None
        if status == "error":
            raise EnvCrashedError(f"Env worker process {rank} (pid {proc.pid}) raised during `{cmd}`:\n{payload}")
        if status == "refused":
            raise EnvCommandError(
                f"Env worker process {rank} refused a command: {payload}. The process is unharmed and "
                "serves on; the caller of SubprocVecEnv sent it, so fix that caller (the commands are "
                "listed in envs/subproc_child.py)."
            )
        return payload

    def _broadcast(self, cmd: str, per_rank_args: list | None = None, on_crash: str = "raise"):
        for rank in range(len(self._pipes)):
            self._send(rank, cmd, None if per_rank_args is None else per_rank_args[rank])
        return self._gather(on_crash=on_crash)

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
            self._broadcast("reset", [self._last_reset.slice(a, b) for a, b in self._slices()], on_crash="restart")
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
            _, restarted = self._broadcast("step", [observe] * len(self._pipes), on_crash="restart")
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
            self._local.set_ignore_terminations(flag)
        else:
            self._broadcast("ignore_terminations", [flag] * len(self._pipes), on_crash="stop")

    def render(self, env_index: int = 0) -> np.ndarray:
        """RGB frame ``[H, W, 3]`` uint8 of one env (needs render support in the backend). A
        process that fails meanwhile raises EnvCrashedError (see the class docstring)."""
        if self._local is not None:
            return self._local.render(env_index)
        if not 0 <= env_index < self.num_envs:
            raise IndexError(f"env_index {env_index} is not one of the {self.num_envs} envs")
        rank, (start, _) = next((r, s) for r, s in enumerate(self._slices()) if s[0] <= env_index < s[1])
        self._send(rank, "render", env_index - start)
        try:
            return self._answer(rank, self.timeout_s)
        except EnvCrashedError as err:
            if not self.restart_crashed:
                self.close(force=True)
                raise
            self._stop(rank)
            raise EnvCrashedError(
                f"{err}\nThe frame is lost with the episode it would show. The process was stopped "
                "(env.restart_crashed): the next step replaces it and ends its envs' episodes as failed by error."
            ) from None

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
                    wait([pipe, proc.sentinel], 10)  # its reply or its exit, whichever comes first
            except OSError:
                pass
            pipe.close()
            proc.join(timeout=5 if not force else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._pipes, self._procs, self._sent = [], [], []
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
