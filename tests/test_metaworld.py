"""MetaWorld (envs/metaworld.py, envs/metaworld_sim.py): env processes in MetaWorld's own interpreter, seeds
that name (task, trial) pairs, the published camera and state, instructions, success, and bad settings
refused before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import imageio
import mujoco
import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.base import decode_instruction
from envs.common import UserError
from envs.metaworld import check_metaworld_render, interpreter, suite_tasks
from envs.metaworld_sim import TASK_STRIDE, TRAIN_TRIALS, decode_seed, episode_seed
from envs.registry import check_env_config, env_episode_steps, make_vec_env, seed_scheme, training_reset_seeds
from envs.seeds import RunSeeds


def _cfg(*overrides: str, env: str = "metaworld_mt10"):
    return compose([f"env={env}", *overrides])


def _reach_action(state: torch.Tensor) -> torch.Tensor:
    """reach-v3's expert in one line: the hand (state[:3]) moves toward the goal (state[36:39])."""
    return torch.cat([((state[:, 36:39] - state[:, :3]) * 50).clamp(-1, 1), torch.zeros(len(state), 1)], 1)


@pytest.mark.integration  # env processes of another interpreter
def test_mt10_runs_in_metaworlds_interpreter_with_its_instructions_and_success():
    """The envs run mujoco 3.3.0 while this process keeps LIBERO's 2.3.7; the observation names the task
    and its instruction; a seed names the same episode in any env, whatever ran there before (replayed step
    for step); success ends a training episode."""
    cfg = _cfg("env.num_envs=3")
    probe = subprocess.run([interpreter(cfg.env), "-c", "import mujoco; print(mujoco.__version__)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "3.3.0" and mujoco.__version__ == "2.3.7"
    envs = make_vec_env(cfg.env)
    try:
        assert envs.action_dim == 4 and envs.max_episode_steps == 500
        assert envs.obs_spec["state"] == ((39,), torch.float32) and envs.obs_spec["task"] == ((10,), torch.float32)
        obs, _ = envs.reset(seed=[episode_seed(0, 7), episode_seed(0, 8), episode_seed(3, 7)])
        assert [decode_instruction(row) for row in obs["instruction"][[0, 2]]] == [
            "Reach a goal position", "Open a door with a revolving joint"]
        assert obs["task"].argmax(1).tolist() == [0, 0, 3]
        assert not torch.equal(obs["state"][0], obs["state"][1])  # another trial: another goal
        again, _ = envs.reset(seed=[episode_seed(0, 8), episode_seed(0, 7), episode_seed(3, 7)])
        assert torch.equal(again["state"][1], obs["state"][0]) and torch.equal(again["state"][2], obs["state"][2])
        states = []
        for _ in range(100):
            step = envs.step(torch.cat([_reach_action(again["state"][:2]), torch.zeros(1, 4)]))
            again = step.obs
            states.append(step.info["final_obs"]["state"][0] if step.done[0] else again["state"][0])
            if step.info["success"][0]:
                break
        assert step.info["success"][0] and step.terminated[0] and not step.terminated[2]
        # the episode again, in another env after other episodes: the same states, step for step
        replay, _ = envs.reset(seed=[episode_seed(3, 7), episode_seed(0, 8), episode_seed(0, 7)])
        for expected in states:
            step = envs.step(torch.cat([torch.zeros(1, 4), _reach_action(replay["state"][1:2]), torch.zeros(1, 4)]))
            replay = step.obs
            assert torch.equal(step.info["final_obs"]["state"][1] if step.done[1] else replay["state"][1], expected)
    finally:
        envs.close()


@pytest.mark.integration
def test_frames_are_upright_and_each_env_draws_its_own_scene():
    """The corner2 camera turned upright (grey wall top right, the wooden table bottom right, the red arm on
    the left), and two envs in one process each render their own model (gymnasium renders into whichever
    GL context is current: before the fix env 0 drew its scene with env 1's meshes)."""
    shared = make_vec_env(_cfg("env.obs_mode=rgb", "env.image_size=64", "env.num_envs=2").env)
    alone = make_vec_env(_cfg("env.obs_mode=rgb", "env.image_size=64", "env.num_envs=1").env)
    try:
        assert shared.obs_spec["state"] == ((4,), torch.float32)
        obs, _ = shared.reset(seed=[episode_seed(2, 0), episode_seed(5, 0)])
        step = shared.step(torch.zeros(2, 4))
        lone = alone.reset(seed=[episode_seed(2, 0)])[0]
        lone = alone.step(torch.zeros(1, 4)).obs
        assert torch.equal(step.obs["rgb"][0], lone["rgb"][0])
        frame = lone["rgb"][0].int().numpy()
        red = (frame[..., 0] > 100) & (frame[..., 1] < 60) & (frame[..., 2] < 60)
        assert red.mean() > 0.05 and red[:, :32].sum() > 5 * red[:, 32:].sum()
        wall, table = frame[:8, -8:].reshape(-1, 3).mean(0), frame[40:, 40:].reshape(-1, 3).mean(0)
        assert np.ptp(wall) < 10 and table[0] - table[2] > 25
        assert np.array_equal(shared.render(0), step.obs["rgb"][0].numpy())
    finally:
        shared.close()
        alone.close()


@pytest.mark.integration
def test_a_killed_metaworld_process_is_replaced_and_its_shared_memory_survives():
    """A process of the other interpreter attaches the parent's shared memory under its own resource
    tracker, which would unlink the blocks when it dies; the replacement must attach them again."""
    envs = make_vec_env(_cfg("env.num_envs=2", "env.num_procs=2", "env.restart_crashed=true").env)
    try:
        envs.reset(seed=[episode_seed(0, 1), episode_seed(1, 1)])
        os.kill(envs._procs[1].pid, signal.SIGKILL)
        step = envs.step(torch.zeros(2, 4))
        assert step.info["error"].tolist() == [False, True] and envs.restarts == 1
        step = envs.step(torch.zeros(2, 4))
        assert not step.info["error"].any() and step.obs["task"].argmax(1).tolist() == [0, 1]
    finally:
        envs.close()


def test_seeds_name_tasks_and_trials_and_training_never_runs_an_evaluation_trial():
    cfg = _cfg("eval.trials_per_task=3", "eval.tasks=[1,4]")
    scheme = seed_scheme(cfg.env)
    seeds = scheme.eval_seeds(cfg.env, cfg.eval)
    assert seeds == [TASK_STRIDE + k for k in range(3)] + [4 * TASK_STRIDE + k for k in range(3)]
    assert scheme.task_of(cfg.env, seeds[-1]) == (4, "drawer-open-v3")
    train = training_reset_seeds(cfg.env, RunSeeds(0), iteration=5, num_envs=20)
    assert [decode_seed(s)[0] for s in train] == [j % 10 for j in range(20)]
    assert all(decode_seed(s)[1] >= TRAIN_TRIALS for s in train)
    assert suite_tasks("mt50")[:2] == ("assembly-v3", "basketball-v3") and len(suite_tasks("mt50")) == 50


@pytest.mark.parametrize("override, named", [
    ("env.task=reach-v9", "reach-v3"),
    ("env.obs_mode=pixels", "'rgb'"),
    ("env.rendering=pretty", "'reference'"),
    ("env.protocol=lerobot", "'rlinf'"),
    ("env.python=/nonexistent/python", "make setup"),
])
def test_bad_metaworld_settings_are_refused_naming_the_fix(override, named):
    with pytest.raises(UserError, match=named):
        check_env_config(_cfg(override, env="metaworld_mt1").env)


def test_the_protocols_step_limits():
    assert env_episode_steps(_cfg(env="metaworld_mt1").env) == 500
    assert env_episode_steps(_cfg("env.protocol=rlinf", env="metaworld_mt1").env) == 100
    assert env_episode_steps(_cfg("env.protocol=rlinf", "env.max_episode_steps=150", env="metaworld_mt1").env) == 150


def test_cli_eval_writes_the_per_task_table_videos_and_the_versions_it_ran(ray_cluster, tmp_path):
    """`embodied eval env=metaworld_mt10 policy=random`, shortened: the per-task table, a video per task from
    the env's own frames, and provenance naming MetaWorld's interpreter and its mujoco, not this one's."""
    from embodied.cli import main as cli_main  # in this process: fresh workers on the session's cluster

    out = tmp_path / "eval"
    assert cli_main(["eval", "env=metaworld_mt10", "policy=random", "eval.trials_per_task=2", "eval.tasks=[9,2]",
                     "env.num_envs=2", "env.max_episode_steps=5", "env.render_size=32", "runner.progress=false",
                     f"runner.run_dir={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert [(t["task_index"], t["task"], t["episodes"]) for t in result["tasks"]] == [
        (2, "pick-place-v3", 2), (9, "window-close-v3", 2)]
    assert result["seeds"] == [episode_seed(t, k) for t in (2, 9) for k in range(2)]
    versions = result["provenance"]["versions"]
    assert versions["mujoco"] == "3.3.0" and versions["metaworld"] == "3.1.1"
    assert versions["env_python"].endswith(".venv-metaworld/bin/python")
    videos = sorted((out / "videos").glob("task_*.mp4"))
    assert [v.name.split("_episode")[0] for v in videos] == ["task_002", "task_009"]
    assert len(imageio.mimread(videos[0])) == 6  # the reset frame and 5 steps


@pytest.mark.integration  # renders in MetaWorld's interpreter
def test_check_render_answers_for_metaworld():
    """A frame rendered through MuJoCo's EGL in MetaWorld's interpreter; an interpreter without metaworld
    (this one) fails, naming the fix; none installed is nothing to check."""
    works, message = check_metaworld_render()
    assert works is True and "64x64 frame rendered" in message
    works, message = check_metaworld_render(sys.executable)
    assert works is False and "cannot import metaworld" in message and "make setup" in message
    assert check_metaworld_render("/nonexistent/python")[0] is None
