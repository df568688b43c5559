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
)
from envs.common import UserError


def _claim(parent: str, barrier, out) -> None:
    barrier.wait()
    out.put(str(make_unique_dir(Path(parent), "PushCube-v1-mlp-20261202-120000")))


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
