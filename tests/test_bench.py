"""`embodied bench pipeline`: the figures it reports hang together, on a real (cheap) workload."""

import json

import pytest

from embodied.bench.pipeline import ModeResult, summarize
from tests.conftest import run_cli

CHEAP = ["env=maniskill_pushcube", "env.num_envs=8", "policy=mlp", "algorithm.rollout_steps=4"]


def test_summary_bounds_from_serial_stage_times():
    modes = [ModeResult("serial colocated", 9.0, 1.0, sim_s=5.0, infer_s=4.0, weight_sync_s=0.0),
             ModeResult("pipelined k=2", 7.5, 1.0, 6.0, 4.0, 0.0),
             ModeResult("pipelined k=4", 8.0, 1.0, 6.0, 4.0, 0.0),
             ModeResult("serial colocated (repeat)", 11.0, 1.0, sim_s=7.0, infer_s=4.0, weight_sync_s=0.0)]
    summary = summarize(modes)  # the baseline is the mean of both serial runs: 10 s, sim 6, infer 4
    assert summary["ideal_speedup"] == 10.0 / 6.0
    assert summary["best_mode"] == "pipelined k=2"
    assert summary["achieved_speedup"] == 10.0 / 7.5
    assert summary["achieved_over_ideal"] == (10.0 / 7.5) / (10.0 / 6.0)
    assert [m["speedup"] for m in summary["modes"]] == [10.0 / 9.0, 10.0 / 7.5, 10.0 / 8.0, 10.0 / 11.0]


@pytest.mark.slow  # ~90 s on 2 cores: the suite must stay under 15 min (the bench's figures are in the notes)
def test_bench_pipeline_json_table_and_timeline(tmp_path):
    proc = run_cli("bench", "pipeline", "--json", "--iterations", "1", *CHEAP, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    names = [m["name"] for m in out["modes"]]
    assert names == ["serial colocated", "pipelined k=1", "pipelined k=2", "pipelined k=4",
                     "serial colocated (repeat)"]
    for mode in out["modes"]:
        assert mode["iter_time_s"] > 0 and mode["sim_s"] > 0 and mode["infer_s"] > 0
        assert abs(mode["env_steps_per_s"] * mode["iter_time_s"] - 32) < 1e-6  # 8 envs x 4 steps
    assert 1.0 <= out["ideal_speedup"] <= 2.0
    serial = (out["modes"][0]["iter_time_s"] + out["modes"][-1]["iter_time_s"]) / 2
    best = min(m["iter_time_s"] for m in out["modes"][1:-1])
    assert abs(out["achieved_speedup"] - serial / best) < 1e-9
    assert abs(out["achieved_over_ideal"] - out["achieved_speedup"] / out["ideal_speedup"]) < 1e-9
    files = {p.split("/")[-1]: p for p in out["files"]}
    assert set(files) == {"results.json", "results.md", "timeline.png"}
    png = (tmp_path / files["timeline.png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (tmp_path / files["results.md"]).read_text()
    assert "| pipelined k=2 |" in table and "ideal speedup" in table


@pytest.mark.slow  # ~2 min on 2 cores: raw ManiSkill processes (two 20 s rounds), then the workers
def test_bench_overhead_real_simulator_row_measures_raw_processes_and_our_collection(tmp_path):
    """`embodied bench overhead maniskill-cpu`: raw simulator processes and our collection both step, and the
    ratio is theirs."""
    proc = run_cli("bench", "overhead", "maniskill-cpu", "--json", "--iterations", "1", "env.num_envs=4",
                   "algorithm.rollout_steps=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(proc.stdout)["settings"]
    [way] = row["ways"]
    assert way["plain"]["way"] == "raw (2 processes)" and way["plain"]["env_steps_per_s"] > 0
    assert way["ours"]["env_steps_per_iteration"] == 16 and way["ours"]["stages"]["env"] > 0
    assert way["ratio"] == pytest.approx(way["ours"]["env_steps_per_s"] / way["plain"]["env_steps_per_s"])
