"""SubprocVecEnv's command protocol with a tiny fake simulator (no ManiSkill: seconds, not minutes):
every command answered, every wait with a deadline, a dead process reported at once, and a
restart on a command other than step. tests/test_vecenv.py covers the same class on ManiSkill."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from envs.subproc import EnvCommandError, EnvCrashedError, SubprocVecEnv

pytestmark = pytest.mark.integration  # env processes: not the fast tier


class TinyEnv:
    """A :class:`~envs.subproc.SingleEnv` whose state is (seed, steps, index); env ``faulty`` does
    what ``fault`` says (env processes import this module to build it)."""

    obs_spec = {"state": ((3,), np.float32)}
    action_dim = 1
    max_episode_steps = 10

    def __init__(self, index: int, fault: str = "", faulty: int = 0, marker: str = ""):
        self.index, self.fault, self.marker = index, fault if index == faulty else "", marker
        self.seed, self.t = 0, 0
        if self.fault == "slow_start":
            time.sleep(3)

    def _obs(self) -> dict[str, np.ndarray]:
        return {"state": np.array([self.seed, self.t, self.index], np.float32)}

    def reset(self, seed: int | None, reconfigure: bool = False) -> dict[str, np.ndarray]:
        if self.fault == "crash_reset_once" and os.path.exists(self.marker):
            os.remove(self.marker)  # once: the replacement's reset goes through
            os._exit(3)
        self.seed, self.t = seed or 0, 0
        return self._obs()

    def step(self, action: np.ndarray, observe: bool = True):
        if self.fault == "slow_step":
            time.sleep(60)
        self.t += 1
        return self._obs(), 1.0, False, self.t >= self.max_episode_steps, False

    def observe(self) -> dict[str, np.ndarray]:
        return self._obs()

    def render(self) -> np.ndarray:
        if self.fault == "hang_render":
            time.sleep(3600)
        return np.full((4, 4, 3), self.index, np.uint8)

    def close(self) -> None:
        pass


def _env(num_envs: int = 2, num_procs: int = 1, timeout_s: float = 30.0, restart: bool = False,
         startup_timeout_s: float = 300.0, **fault) -> SubprocVecEnv:
    return SubprocVecEnv(functools.partial(TinyEnv, **fault), num_envs, num_procs, timeout_s=timeout_s,
                         restart_crashed=restart, startup_timeout_s=startup_timeout_s)


def _zeros(env: SubprocVecEnv) -> torch.Tensor:
    return torch.zeros(env.num_envs, env.action_dim)


def test_an_unknown_command_is_refused_at_once_and_the_process_serves_on():
    env = _env(num_envs=4, num_procs=2, timeout_s=30, restart=True)
    try:
        env.reset(seed=0)
        started = time.monotonic()
        with pytest.raises(EnvCommandError, match="unknown command 'frobnicate'"):
            env._broadcast("frobnicate", on_crash="restart")
        assert time.monotonic() - started < 5  # refused, not a hang found at the 30 s deadline
        result = env.step(_zeros(env))  # both processes read their refusal: no stale reply is left
        assert not result.info["error"].any() and env.restarts == 0
        assert result.obs["state"][:, 1].tolist() == [1, 1, 1, 1]
        assert env.render(3).max() == 3
    finally:
        env.close()


def test_building_the_envs_has_its_own_deadline_env_startup_timeout_s():
    """A start slower than ``timeout_s`` is waited for up to ``startup_timeout_s``, and no longer
    (env 1 takes 3 s to build; env 0 is built in this process, to learn the shapes)."""
    env = _env(num_envs=2, num_procs=1, timeout_s=1, startup_timeout_s=30, fault="slow_start", faulty=1)
    try:
        assert env.reset(seed=0)[0]["state"].shape == (2, 3)
    finally:
        env.close()
    started = time.monotonic()
    with pytest.raises(EnvCrashedError, match=r"(?s)did not answer `start` within 2 s.*env.startup_timeout_s"):
        _env(num_envs=2, num_procs=1, timeout_s=1, startup_timeout_s=2, fault="slow_start", faulty=1)
    assert time.monotonic() - started < 10


def test_render_of_a_hung_process_fails_at_its_deadline_and_the_next_step_replaces_it():
    env = _env(num_envs=4, num_procs=2, timeout_s=2, restart=True, fault="hang_render", faulty=2)
    try:
        env.reset(seed=[10, 11, 12, 13])
        env.step(_zeros(env))
        started = time.monotonic()
        with pytest.raises(EnvCrashedError, match=r"(?s)did not answer `render` within 2 s.*frame is lost"):
            env.render(2)
        assert 2 <= time.monotonic() - started < 10
        result = env.step(_zeros(env))  # the stopped process is replaced; its episodes end failed
        assert result.info["error"].tolist() == [False, False, True, True] and env.restarts == 1
        assert result.obs["state"][2:, :2].tolist() == [[12, 0], [13, 0]]  # restarted from their reset seeds
        assert result.obs["state"][:2, 1].tolist() == [2, 2]
    finally:
        env.close()


def test_a_process_killed_mid_wait_is_reported_at_once_with_its_exit_status():
    env = _env(num_envs=2, num_procs=1, timeout_s=60, fault="slow_step")
    pid = env._procs[0].pid
    try:
        env.reset(seed=0)
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(EnvCrashedError, match=rf"process 0 \(pid {pid}\) died during `step` \(exit code -9\)"):
            env.step(_zeros(env))
        assert time.monotonic() - started < 10  # not the 60 s deadline
        killer.join()
    finally:
        env.close(force=True)


def test_a_process_that_dies_during_reset_is_replaced_and_the_reset_redone(tmp_path):
    marker = tmp_path / "crash"
    env = _env(num_envs=4, num_procs=2, restart=True, fault="crash_reset_once", faulty=3, marker=str(marker))
    try:
        marker.touch()
        obs, _ = env.reset(seed=[20, 21, 22, 23])
        assert not marker.exists() and env.restarts == 1
        assert obs["state"].tolist() == [[20, 0, 0], [21, 0, 1], [22, 0, 2], [23, 0, 3]]
        assert not env.step(_zeros(env)).info["error"].any()  # the batch goes on
    finally:
        env.close()


def test_a_process_lost_during_set_ignore_terminations_is_replaced_by_the_next_step():
    env = _env(num_envs=4, num_procs=2, restart=True)
    try:
        env.reset(seed=[30, 31, 32, 33])
        env.step(_zeros(env))
        os.kill(env._procs[0].pid, signal.SIGKILL)
        env.set_ignore_terminations(True)  # no raise: the flag is for the replacement
        result = env.step(_zeros(env))
        assert result.info["error"].tolist() == [True, True, False, False] and env.restarts == 1
        assert result.truncated[:2].all() and result.info["final_obs"]["state"][:2, 1].tolist() == [1, 1]
    finally:
        env.close()
