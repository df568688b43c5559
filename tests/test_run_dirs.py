"""Where commands write (embodied/run_dirs.py): directories nobody else has, an index of a run's
evaluations, and a resumed run that files its earlier final evaluation away."""

import json
import multiprocessing as mp
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
