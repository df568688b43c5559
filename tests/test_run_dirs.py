"""Where commands write (embodied/run_dirs.py): directories nobody else has, an index of a run's
evaluations, and a resumed run that files its earlier final evaluation away."""

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from embodied.run_dirs import (
    claim_dir,
    file_away_final_eval,
    index_evaluation,
    make_unique_dir,
    read_index,
    written_whole,
)
from envs.common import UserError


def _claim(parent: str, barrier, out) -> None:
    barrier.wait()
    out.put(str(make_unique_dir(Path(parent), "PushCube-v1-mlp-20261202-120000")))


@pytest.mark.integration  # eight processes
def test_commands_started_at_once_get_their_own_directories(tmp_path):
    """Eight processes claim the same name in the same instant: eight directories."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    claimed = {out.get(timeout=5) for _ in procs}
    assert len(claimed) == 8 and all(p.exitcode == 0 for p in procs)


def test_a_directory_holding_results_is_refused_and_an_empty_one_is_used(tmp_path):
    assert claim_dir(str(tmp_path / "new"), tmp_path, "x", "this eval").is_dir()
    (tmp_path / "new" / "eval.json").write_text("{}")
    with pytest.raises(UserError, match="already holds results"):
        claim_dir(str(tmp_path / "new"), tmp_path, "x", "this eval")


def _summary(success: float, iteration: int) -> dict:
    return {"episodes": 4, "success_once": success, "success_at_end": 0.0, "return_mean": 1.0,
            "evaluated": {"iteration": iteration}}


def test_a_resumed_run_files_its_earlier_final_eval_away(tmp_path):
    run = tmp_path / "run"
    (run / "videos").mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps(_summary(0.5, 3)))
    (run / "eval.md").write_text("table")
    index_evaluation(run, run, _summary(0.5, 3), "train", "ckpt_000003.pt", "abcd1234")
    file_away_final_eval(run)
    (moved,) = (run / "evals").glob("final-3-*")
    assert json.loads((moved / "eval.json").read_text())["success_once"] == 0.5
    assert (moved / "eval.md").exists() and (moved / "videos").is_dir() and not (run / "eval.json").exists()
    (entry,) = read_index(run)
    assert entry["path"] == str(moved.resolve()) and entry["checkpoint"] == "ckpt_000003.pt"


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_results_written_whole_or_not_at_all(tmp_path, interruption):
    """An interrupted write leaves neither the directory nor its staging copy; a finished one leaves
    exactly the files written, under the final name."""
    final = make_unique_dir(tmp_path, "eval")
    with pytest.raises(interruption), written_whole(final) as staging:
        (staging / "eval.json").write_text("{}")
        raise interruption
    assert list(tmp_path.iterdir()) == []
    final = make_unique_dir(tmp_path, "eval")
    with written_whole(final) as staging:
        (staging / "videos").mkdir()
        (staging / "eval.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]
    assert sorted(p.name for p in final.iterdir()) == ["eval.json", "videos"]


def test_results_join_a_run_dir_holding_other_files_and_leave_them(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with written_whole(tmp_path) as staging:
        (staging / "eval.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "notes.txt"]


def test_an_eval_stopped_before_its_end_leaves_no_directory(tmp_path, monkeypatch):
    """``embodied eval`` makes its result directory only once the episodes have run."""
    from embodied.commands import eval as eval_command

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eval_command, "run_protocol", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eval_command.evaluate(["eval.episodes=2"])
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def _hold(path: str, taken, stop) -> None:
    from embodied import run_owner

    run_owner.take(Path(path), "the first command")
    taken.set()
    stop.wait(60)


@pytest.mark.integration  # a second process
def test_a_directory_held_by_a_live_command_is_refused_naming_it_and_a_dead_ones_is_taken_over(tmp_path):
    """One owner per directory: a second command is refused with the owner's pid; once the owner dies
    (SIGKILL: nothing released by hand) its lock is gone with it and the next command takes over, saying so."""
    from embodied import run_owner

    ctx = mp.get_context("spawn")
    taken, stop = ctx.Event(), ctx.Event()
    owner = ctx.Process(target=_hold, args=(str(tmp_path / "run"), taken, stop))
    owner.start()
    try:
        assert taken.wait(60)
        with pytest.raises(UserError, match=f"in use by pid {owner.pid} on .*mix the two commands"):
            claim_dir(str(tmp_path / "run"), tmp_path, "x", "this training")
        assert run_owner.owner_of(tmp_path / "run")["pid"] == owner.pid  # the refusal touched nothing
    finally:
        owner.kill()
        owner.join(30)
    note = run_owner.take(tmp_path / "run", "this training")
    try:
        assert f"pid {owner.pid}" in note and "taken over" in note
        assert run_owner.owner_of(tmp_path / "run")["pid"] == os.getpid()
    finally:
        run_owner.release(tmp_path / "run")
    assert not (tmp_path / "run" / run_owner.OWNER_FILE).exists()


@pytest.mark.e2e
def test_train_and_resume_on_a_directory_in_use_exit_2_before_anything_starts(tmp_path):
    """The acceptance's second ``embodied train`` on a run dir in use, as a user meets it: exit 2 in seconds
    (no Ray, no workers), one paragraph naming the owner; ``resume=`` of it the same; nothing written."""
    from tests.conftest import run_cli

    ctx = mp.get_context("spawn")
    taken, stop = ctx.Event(), ctx.Event()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}")  # a run in progress (its config is what resume= reads)
    owner = ctx.Process(target=_hold, args=(str(run), taken, stop))
    owner.start()
    try:
        assert taken.wait(60)
        before = sorted(p.name for p in run.iterdir())
        for command in (["train", f"runner.run_dir={tmp_path / 'run'}"], ["train", f"resume={run}"]):
            proc = run_cli(*command, timeout=120)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert f"in use by pid {owner.pid}" in proc.stderr and "Traceback" not in proc.stderr
            assert "starting Ray" not in proc.stderr + proc.stdout
        assert sorted(p.name for p in run.iterdir()) == before
    finally:
        stop.set()
        owner.join(30)


def test_a_command_that_fails_before_writing_leaves_no_directory_and_no_lock(tmp_path):
    from embodied import run_owner
    from embodied.commands.common import removed_if_failed_empty

    path = claim_dir(str(tmp_path / "new"), tmp_path, "x", "this training")
    with pytest.raises(RuntimeError), removed_if_failed_empty(path):
        raise RuntimeError("workers failed to start")
    assert not path.exists() and not run_owner.holds(path)
    kept = tmp_path / "mine"
    kept.mkdir()
    claim_dir(str(kept), tmp_path, "x", "this eval")  # a directory the user made is never removed
    run_owner.release(kept)
    assert kept.is_dir() and list(kept.iterdir()) == []


# two training runs; the default tier's test_train_and_resume_on_a_directory_in_use_exit_2_before_anything_starts
# covers the refusal
@pytest.mark.slow
def test_two_trains_on_one_run_dir_8_s_apart_the_second_refused_the_first_keeps_every_file(tmp_path):
    """Issue 57's acceptance: the second exits 2 within 30 s; the first finishes, and every file in the
    directory is its own (its seed in config.yaml, in the checkpoint's config and in eval.json's provenance)."""
    import subprocess
    import sys
    import time

    from omegaconf import OmegaConf

    from embodied.checkpoint import load_checkpoint
    from embodied.config import load_yaml
    from tests.conftest import REPO, SMALL_OVERRIDES

    run = tmp_path / "run"
    args = [sys.executable, "-m", "embodied.cli", "train", *SMALL_OVERRIDES, "runner.total_env_steps=160",
            "runner.checkpoint_every=1", "eval.episodes=4", "eval.video_episodes=0", f"runner.run_dir={run}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    first = subprocess.Popen([*args, "runner.seed=11"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(8)
    t0 = time.monotonic()
    second = subprocess.run([*args, "runner.seed=22"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    refused_s = time.monotonic() - t0
    out, err = first.communicate(timeout=900)
    assert second.returncode == 2 and f"in use by pid {first.pid}" in second.stderr, second.stderr[-2000:]
    assert refused_s < 30, refused_s
    assert first.returncode == 0, err[-3000:]
    assert load_yaml(run / "config.yaml").runner.seed == 11
    assert OmegaConf.create(load_checkpoint(run)["config_yaml"]).runner.seed == 11
    assert json.loads((run / "eval.json").read_text())["provenance"]["weights"]["checkpoint"].startswith(str(run))
    assert not (run / "evals").exists() or [e["kind"] for e in read_index(run)] == ["train"]
    assert not (run / ".owner.json").exists()  # released when the first ended
