"""The progress bar and TensorBoard scalars a person watches (embodied/run_logger.py)."""

from __future__ import annotations

from embodied.run_logger import RunLogger


def test_the_progress_bar_counts_to_the_steps_the_time_limit_allows_when_it_binds_first(tmp_path):
    """``make train`` once showed 1.00M steps and a 6-28 hour ETA for a run capped at 28 minutes."""
    capped = RunLogger(tmp_path / "a", total_steps=1_000_000, progress=False, max_seconds=60)
    capped.advance(1000, elapsed_s=6.0)  # 1000 steps in 6 s: 10,000 by the 60 s limit
    assert capped.expected_steps == 10_000 and capped.description == "train (1 min cap)"
    capped.advance(1000, elapsed_s=10.0)  # faster now: 200 steps/s since the start
    assert capped.expected_steps == 2000 + 200 * 50
    resumed = RunLogger(tmp_path / "b", total_steps=5000, initial_steps=4000, progress=False, max_seconds=600,
                        elapsed_s=100.0)
    resumed.advance(100, elapsed_s=101.0)  # the steps bind first: their total stays
    assert resumed.expected_steps == 5000
    plain = RunLogger(tmp_path / "c", total_steps=5000, progress=False)
    plain.advance(100, elapsed_s=1.0)
    assert plain.expected_steps == 5000
    for log in (capped, resumed, plain):
        log.close()
