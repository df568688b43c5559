"""Checkpoints verify (a SHA-256 beside each), a run resolves to its newest that reads, and ``resume=``
goes on past a damaged one (or from a file named) without deleting anything (embodied/checkpoint.py,
embodied/commands/train.py ``resume_point``)."""

import hashlib
from pathlib import Path

import pytest
import torch

from embodied.checkpoint import (
    Progress,
    checkpoint_state,
    checksum_path,
    load_checkpoint,
    newest_checkpoint,
    resolve_checkpoint,
    save_best_checkpoint,
    save_checkpoint,
)
from envs.common import UserError


def _state(iteration: int, best_iteration: int | None = None) -> dict:
    progress = Progress(iteration=iteration, env_steps=10 * iteration, best_iteration=best_iteration)
    return checkpoint_state({"policy": {"w": torch.full((64,), float(iteration))}}, progress, "{}", {}, 2)


def _run(tmp_path: Path, iterations=(2, 4, 6)) -> Path:
    (tmp_path / "config.yaml").write_text("{}")
    for it in iterations:
        save_checkpoint(tmp_path, it, _state(it), keep=5)
    return tmp_path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_each_checkpoint_has_its_sha256_beside_it_in_sha256sum_format(tmp_path):
    path = save_checkpoint(tmp_path, 3, _state(3), keep=1)
    digest, name = checksum_path(path).read_text().split()
    assert name == path.name and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    save_checkpoint(tmp_path, 4, _state(4), keep=1)
    assert not path.exists() and not checksum_path(path).exists()  # pruned with its checkpoint


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_run_resolves_to_its_newest_checkpoint_that_verifies(tmp_path, damage):
    run = _run(tmp_path)
    newest = run / "checkpoints" / "ckpt_000006.pt"
    if damage == "truncated":
        _truncate(newest)
    else:  # one byte changed: the zip may still read, the checksum does not match
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    path, state, skipped = newest_checkpoint(run)
    assert path.name == "ckpt_000004.pt" and state["progress"]["iteration"] == 4
    assert [s.path.name for s in skipped] == ["ckpt_000006.pt"] and "SHA-256" in skipped[0].reason
    assert resolve_checkpoint(run).name == "ckpt_000004.pt"
    assert load_checkpoint(run)["progress"]["iteration"] == 4
    assert newest.exists()  # passed over, never deleted
    with pytest.raises(UserError, match="ckpt_000006.pt could not be read"):
        load_checkpoint(newest)  # named explicitly: refused, not silently replaced


def test_a_checkpoint_written_before_checksums_is_read_and_one_that_does_not_read_is_passed_over(tmp_path):
    run = _run(tmp_path)
    for path in (run / "checkpoints").glob("*.sha256"):
        path.unlink()
    _truncate(run / "checkpoints" / "ckpt_000006.pt")
    path, _, skipped = newest_checkpoint(run)
    assert path.name == "ckpt_000004.pt" and skipped[0].path.name == "ckpt_000006.pt"


def test_a_run_with_no_readable_checkpoint_is_refused_naming_each(tmp_path):
    run = _run(tmp_path, iterations=(2, 4))
    for path in (run / "checkpoints").glob("ckpt_*.pt"):
        _truncate(path)
    with pytest.raises(UserError, match="ckpt_000004.pt: .*ckpt_000002.pt: .*left as they are"):
        newest_checkpoint(run)


def test_resume_goes_on_past_a_damaged_checkpoint_and_keeps_it(tmp_path, capsys):
    from embodied import run_owner
    from embodied.commands.train import resume_point

    run = _run(tmp_path)
    _truncate(run / "checkpoints" / "ckpt_000006.pt")
    try:
        run_dir, state = resume_point(str(run))
    finally:
        run_owner.release(run)
    assert run_dir == run and state["progress"]["iteration"] == 4
    (kept,) = (run / "checkpoints").glob("broken-*")
    assert (kept / "ckpt_000006.pt").exists() and (kept / "ckpt_000006.pt.sha256").exists()
    assert resolve_checkpoint(run).name == "ckpt_000004.pt"
    err = capsys.readouterr().err
    assert "passed over ckpt_000006.pt" in err and "from ckpt_000004.pt (iteration 4)" in err


def test_resume_from_a_checkpoint_file_sets_newer_ones_and_a_later_best_aside(tmp_path):
    from embodied import run_owner
    from embodied.commands.train import resume_point

    run = _run(tmp_path)
    save_best_checkpoint(run, _state(6, best_iteration=6))  # validated after iteration 2
    try:
        run_dir, state = resume_point(str(run / "checkpoints" / "ckpt_000002.pt"))
    finally:
        run_owner.release(run)
    assert run_dir == run and state["progress"]["iteration"] == 2
    (kept,) = (run / "checkpoints").glob("after-ckpt_000002-*")
    assert sorted(p.name for p in kept.glob("*.pt")) == ["best.pt", "ckpt_000004.pt", "ckpt_000006.pt"]
    assert resolve_checkpoint(run).name == "ckpt_000002.pt"


def test_resume_of_something_that_is_no_run_says_what_to_pass(tmp_path):
    from embodied.commands.train import resume_point

    stray = tmp_path / "ckpt.pt"
    torch.save(_state(1), stray)
    for given in (tmp_path, stray):
        with pytest.raises(UserError, match="no training run there"):
            resume_point(str(given))
