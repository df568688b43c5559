"""The evaluation protocol: every episode of the backend's seed scheme runs exactly once, on
real workers; per-task tables; videos from the eval's own frames; LIBERO's (task, init) seeds."""

import json

import imageio.v2 as imageio
import numpy as np
import pytest

from embodied.config import compose
from embodied.evaluate import (
    markdown_table,
    paired_gain,
    summarize,
    video_episodes,
    wilson_interval,
)
from embodied.runner import start_workers
from envs.common import UserError
from envs.libero import decode_seed, episode_seed
from envs.registry import seed_scheme, training_reset_seeds
from envs.seeds import RunSeeds
from tests.conftest import REPO, small_config


def test_libero_eval_seeds_are_every_task_init_pair_once_grouped_by_task():
    cfg = compose(["env=libero_spatial", "eval.trials_per_task=5"])
    seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    pairs = [decode_seed(s) for s in seeds]
    assert pairs == [(t, i) for t in range(10) for i in range(5)]
    cfg.eval.trials_per_task = 50
    assert len(set(seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval))) == 500
    cfg.eval.tasks, cfg.eval.trials_per_task = [7, 2, 7], 3  # a subset: sorted, each task once
    assert [decode_seed(s) for s in seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)] == \
        [(t, i) for t in (2, 7) for i in range(3)]


@pytest.mark.parametrize("env, tasks", [("libero_spatial", 10), ("metaworld_mt1", 1), ("metaworld_mt10", 10)])
def test_a_suite_runs_exactly_eval_episodes_spread_over_its_tasks(env, tasks):
    """``eval.episodes`` on a suite: that many of the protocol's episodes, trial by trial across tasks, still
    run task by task; null: all of them; more than the protocol has: refused naming the fix."""
    cfg = compose([f"env={env}", "eval.trials_per_task=4"])
    scheme = seed_scheme(cfg.env)
    assert len(scheme.eval_seeds(cfg.env, cfg.eval)) == 4 * tasks  # null: the protocol
    for episodes in (1, 2, tasks + 1, 4 * tasks):
        cfg.eval.episodes = episodes
        seeds = scheme.eval_seeds(cfg.env, cfg.eval)
        task_of = [scheme.task_of(cfg.env, s)[0] for s in seeds]
        assert len(seeds) == len(set(seeds)) == episodes
        assert task_of == sorted(task_of)  # task by task
        per_task = [task_of.count(t) for t in sorted(set(task_of))]
        assert len(per_task) == min(episodes, tasks) and max(per_task) - min(per_task) <= 1  # an even share
    cfg.eval.episodes = 4 * tasks + 1
    with pytest.raises(UserError, match=f"eval.episodes={4 * tasks + 1}: .*Set eval.episodes={4 * tasks} or fewer"):
        scheme.eval_seeds(cfg.env, cfg.eval)


def test_libero_training_slots_spread_tasks_and_are_seeded():
    cfg = compose(["env=libero_spatial"]).env
    seeds = training_reset_seeds(cfg, RunSeeds(1), iteration=3, num_envs=20)
    assert [decode_seed(s)[0] for s in seeds] == [k % 10 for k in range(20)]
    assert all(0 <= decode_seed(s)[1] < 50 for s in seeds)
    assert seeds == training_reset_seeds(cfg, RunSeeds(1), iteration=3, num_envs=20)  # seeded
    assert seeds != training_reset_seeds(cfg, RunSeeds(2), iteration=3, num_envs=20)
    assert seeds != training_reset_seeds(cfg, RunSeeds(1), iteration=4, num_envs=20)


def test_per_task_table_and_suite_mean():
    cfg = compose(["env=libero_spatial"]).env
    rows = [{"seed": episode_seed(t, i), "success_once": t == 0 or (t == 1 and i == 0), "success_at_end": False,
             "return": 0.0, "length": 220, "error": t == 2 and i == 1} for t in range(3) for i in range(2)]
    summary = summarize(rows, cfg)
    assert [t["task_index"] for t in summary["tasks"]] == [0, 1, 2]
    assert [t["success_once"] for t in summary["tasks"]] == [1.0, 0.5, 0.0]
    assert summary["suite_mean"] == pytest.approx(0.5) and summary["errors"] == 1
    table = markdown_table(summary)
    assert table.count("\n| ") == 4 and "suite mean" in table and "failed-by-error" in table


def test_videos_go_to_each_tasks_first_episodes():
    cfg = compose(["env=libero_spatial"]).env
    seeds = [episode_seed(t, i) for t in range(3) for i in range(4)]
    assert video_episodes(seeds, cfg, per_task=1) == {0, 4, 8}
    assert video_episodes(seeds, cfg, per_task=2) == {0, 1, 4, 5, 8, 9}


# slow, 23 s: tests/test_train_e2e.py's test_cli_train_then_eval_and_record evaluates 6 seeds on 4 envs (each
# once, a padded round, 51-frame videos) and tests/test_eval_exact.py's episodes depend on their seeds only
@pytest.mark.slow
def test_every_seed_runs_exactly_once_with_padding(ray_cluster):
    """7 episodes on 4 envs: two rounds, one padded slot whose episode is not reported; the
    recorded episodes' frames are the eval's own (T + 1 frames)."""
    cfg = small_config("env.max_episode_steps=6", "env.render_size=32")
    workers = start_workers(cfg)
    try:
        seeds = [50 + k for k in range(7)]
        rows, videos = workers.evaluate(seeds, deterministic=True, record={0, 6})
        again, _ = workers.evaluate(seeds[6:], deterministic=True)
    finally:
        workers.shutdown()
    assert [r["seed"] for r in rows] == seeds and [r["episode"] for r in rows] == list(range(7))
    assert set(videos) == {0, 6} and videos[0]["frames"].shape == (7, 32, 32, 3)
    assert again[0] | {"episode": 6, "env": rows[6]["env"]} == rows[6]  # an episode depends on its seed only


def test_cli_eval_on_libero_writes_the_per_task_table_and_a_video_per_task(ray_cluster, tmp_path):
    from embodied.cli import main as cli_main  # in this process: fresh workers on the session's cluster

    out = tmp_path / "eval"
    assert cli_main(["eval", "env=libero_spatial", "policy=random", "eval.trials_per_task=1", "eval.tasks=[9,0]",
                     "env.max_episode_steps=4", "env.image_size=32", "runner.progress=false",
                     f"runner.run_dir={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert [t["task_index"] for t in result["tasks"]] == [0, 9] and result["task_subset"] == [0, 9]
    assert all(t["episodes"] == 1 and t["success_once"] == 0.0 for t in result["tasks"])
    assert result["seeds"] == [episode_seed(t, 0) for t in (0, 9)] and result["suite_mean"] == 0.0
    assert result["policy"] == "random" and result["env_steps_per_s"] > 0
    what = result["provenance"]  # what was evaluated, for an audit: settings, code, versions, the whole config
    assert what["settings"]["trials_per_task"] == 1 and what["settings"]["env_image_size"] == 32
    assert what["settings"]["rendering"] == "fast"
    assert what["weights"]["model_path"] is None and len(what["code"]["commit"] or "x" * 40) == 40
    assert {"torch", "transformers", "mujoco"} <= set(what["versions"])
    assert "trials_per_task: 1" in (out / "config.yaml").read_text()
    table = (out / "eval.md").read_text()
    assert table.count("\n| ") == 3 and "Only tasks 0, 9 ran" in table  # 2 tasks, then the suite
    videos = sorted((out / "videos").glob("task_*.mp4"))
    assert len(videos) == 2
    frames = imageio.mimread(videos[1])
    assert len(frames) == 5 and frames[0].shape[1] == 2 * frames[0].shape[0]  # agentview | wrist


@pytest.mark.slow  # 44 s; test_libero.py checks the reference rendering against the authors' pixels by default
def test_eval_of_a_public_checkpoint_config_shows_the_policy_robosuites_default_render(ray_cluster):
    """The shipped tiny L1 OFT fixture evaluated with its public config (256 px, ``reference``
    rendering), through the eval's own workers and env processes: the episode's first frame (both
    cameras, after the reset and the settle steps) equals byte for byte what a plain LIBERO
    ``ControlEnv`` with robosuite's defaults renders for that episode, replayed as the authors do.
    Later frames follow from the same env code: test_libero.py replays actions through both."""
    from libero.libero.envs.env_wrapper import ControlEnv

    from envs.libero import NOOP_ACTION, suite_tasks

    fixture = REPO / "assets" / "reference" / "openvla_oft_l1_tiny"
    cfg = compose(["env=libero_spatial", "policy=openvla_oft_7b_libero", f"policy.vla.model_path={fixture}",
                   "policy.vla.dtype=float32", "policy.vla.unnorm_key=libero_spatial_no_noops", "env.num_envs=1",
                   "placement.env_workers=1", "env.max_episode_steps=8", "runner.progress=false"])
    assert (cfg.env.image_size, cfg.env.rendering) == (256, "reference")  # what the public config sets
    seed = episode_seed(0, 2)
    workers = start_workers(cfg)
    try:
        _, videos = workers.evaluate([seed], deterministic=True, record={0})
    finally:
        workers.shutdown()
    frames = videos[0]["frames"]
    assert frames.shape == (1 + 8, 256, 512, 3) and not (frames[0] == frames[-1]).all()  # the checkpoint acted
    task, init = decode_seed(seed)
    plain = ControlEnv(bddl_file_name=suite_tasks("libero_spatial")[task].bddl_file, camera_heights=256,
                       camera_widths=256)
    try:
        plain.seed(seed)
        plain.reset()
        plain.set_init_state(suite_tasks("libero_spatial")[task].init_states[init])
        for _ in range(10):
            raw = plain.step(NOOP_ACTION)[0]
    finally:
        plain.close()
    authors = np.concatenate([raw["agentview_image"][::-1], raw["robot0_eye_in_hand_image"][::-1]], axis=1)
    np.testing.assert_array_equal(frames[0], authors)


@pytest.mark.parametrize("successes,episodes", [(0, 10), (3, 10), (20, 100), (100, 100), (1, 1)])
def test_wilson_interval_holds_the_rate_and_stays_in_the_unit_interval(successes, episodes):
    lo, hi = wilson_interval(successes, episodes)
    assert 0.0 <= lo <= successes / episodes <= hi <= 1.0
    assert hi - lo > 0  # never falsely certain, not even at 0 or all successes
    wider_lo, wider_hi = wilson_interval(successes, episodes, z=2.576)  # 99%
    assert wider_lo <= lo and hi <= wider_hi


def test_wilson_interval_matches_the_textbook_value_and_narrows_with_episodes():
    # 20 of 100: the Wilson 95% interval is 0.133-0.289 (Newcombe 1998's method 3)
    assert wilson_interval(20, 100) == pytest.approx((0.1333, 0.2888), abs=1e-4)
    widths = [hi - lo for lo, hi in (wilson_interval(n // 5, n) for n in (25, 100, 400))]
    assert widths[0] > widths[1] > widths[2] and widths[1] == pytest.approx(2 * widths[2], rel=0.1)


def test_paired_gain_is_the_mean_per_seed_difference_with_a_t_like_interval():
    before = [{"seed": s, "success_once": s % 2 == 0} for s in range(8)]
    after = [{"seed": s, "success_once": s % 2 == 0 or s in (1, 3, 5)} for s in reversed(range(8))]  # any order
    gain = paired_gain(before, after)
    diffs = [1, 1, 1] + [0] * 5
    sd = (sum((d - 3 / 8) ** 2 for d in diffs) / 7) ** 0.5
    assert gain["gain"] == pytest.approx(3 / 8) and gain["episodes"] == 8
    assert gain["ci95"] == pytest.approx([3 / 8 - 1.96 * sd / 8 ** 0.5, 3 / 8 + 1.96 * sd / 8 ** 0.5], rel=1e-3)
    assert (gain["improved"], gain["worsened"]) == (3, 0)
    assert paired_gain(before, before)["ci95"] == [0.0, 0.0]


def test_paired_gain_refuses_different_seeds():
    rows = [{"seed": s, "success_once": True} for s in range(4)]
    with pytest.raises(ValueError, match="same non-empty seeds"):
        paired_gain(rows, rows[:3])


def test_eval_summary_and_table_carry_the_success_interval():
    cfg = compose([]).env
    rows = [{"seed": k, "success_once": k < 20, "success_at_end": k < 10, "return": 1.0, "length": 50}
            for k in range(100)]
    summary = summarize(rows, cfg)
    assert summary["success_once_ci95"] == pytest.approx(list(wilson_interval(20, 100)))
    assert "| 0.133-0.289 |" in markdown_table(summary)
