"""``embodied bench pipeline``: serial colocated vs elastic pipelining, measured in one run.

For each mode the bench builds the real worker groups (the runner's ``Workers``),
runs one warm-up iteration, then ``iterations`` measured ones. An iteration is what
pipelining changes: weight sync plus ``algorithm.rollout_steps`` steps of every env
(env workers <-> rollout workers). The PPO update runs the same in every mode and is
left out. Stage times come from the serial run: ``sim`` is the env worker's busy
time (stepping, rendering, sending observations), ``infer`` the rollout worker's
(policy forward, bookkeeping, sending actions). With two stages that overlap
perfectly the ideal speedup is ``(sim + infer) / max(sim, infer)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from embodied.config import compose

# the default workload: CPU-rendered 128px RGB and a CNN wide enough that one inference
# costs about one simulator step (~35 ms per env on lavapipe); 50 steps = one PushCube
# episode per env, so the pipeline's fill and drain (one micro-batch each) weigh little
DEFAULT_OVERRIDES = [
    "env=maniskill_pushcube_rgb", "env.image_size=128", "env.num_envs=8", "env.num_procs=0",
    "policy=cnn_wide", "algorithm.rollout_steps=50",
    "placement.env_workers=1", "placement.rollout_workers=1", "placement.actor_workers=1",
    # a worker gets its device's core and no other, so serial and pipelined compare fairly
    "placement.pin_cpus=true",
]
SERIAL = ["placement.mode=colocated", "placement.env=0", "placement.rollout=0", "placement.actor=0",
          "placement.pipeline_stages=1"]


def _pipelined(stages: int) -> list[str]:
    return ["placement.mode=hybrid", "placement.env=0", "placement.rollout=1", "placement.actor=0-1",
            f"placement.pipeline_stages={stages}"]


# serial runs first and again last: this machine drifts by several percent over minutes, and
# the baseline (speedups, the ideal bound) is the mean of the two
MODES = ([("serial colocated", SERIAL)] + [(f"pipelined k={k}", _pipelined(k)) for k in (1, 2, 4)]
         + [("serial colocated (repeat)", SERIAL)])


@dataclass
class ModeResult:
    name: str
    iter_time_s: float  # mean over measured iterations
    env_steps_per_s: float
    sim_s: float  # env worker busy time per iteration
    infer_s: float  # rollout worker busy time per iteration
    weight_sync_s: float
    trace: list[tuple[str, str, float, float]] = field(default_factory=list)  # lane, stage, start, end
    env_steps_per_iteration: int = 0  # simulator steps (a chunked VLA's decision is chunk_size of them)


def _measure(name: str, cfg, iterations: int, on_iteration) -> ModeResult:
    from embodied.runner import start_workers

    workers = start_workers(cfg)
    try:
        workers.reset_envs(iteration=0, sim_steps=0)
        steps = workers.steps_per_rollout  # decisions per env, as the trainer rolls out
        steps_per_iter = workers.layout.env_steps(steps)  # simulator steps, as the trainer counts them
        rows = []
        for i in range(iterations + 1):  # the first is a warm-up (renderer setup, lazy init)
            t0, wall0 = time.perf_counter(), time.time()
            sync = workers.prepare_generation(force_sync=True)  # as after a PPO update
            wall1 = time.time()
            _, _, times = workers.rollout_steps(steps)
            if i > 0:
                rows.append((time.perf_counter() - t0, times["env_sim_s"], times["infer_s"], sync["weight_sync_s"]))
                on_iteration()
        trace = [("driver", "weight sync", wall0, wall1)]
        for group in ("env", "rollout"):
            for rank, events in enumerate(getattr(workers, group).call("last_trace")):
                trace += [(f"{group} {rank}", stage, start, end) for stage, start, end in events]
    finally:
        workers.shutdown()
    mean = [sum(col) / len(col) for col in zip(*rows, strict=True)]
    return ModeResult(name, mean[0], steps_per_iter / mean[0], mean[1], mean[2], mean[3],
                      [(lane, stage, start - wall0, end - wall0) for lane, stage, start, end in trace], steps_per_iter)


def run(overrides: list[str], iterations: int = 2, out_dir: Path | None = None, progress: bool = True) -> dict:
    """Measure every mode; write ``results.json``, ``results.md`` and ``timeline.png``; return the results."""
    configs = [(name, compose([*DEFAULT_OVERRIDES, *mode, *overrides])) for name, mode in MODES]
    results = []
    with tqdm(total=iterations * len(configs), desc="bench pipeline", unit="iter", disable=not progress) as bar:
        for name, cfg in configs:
            bar.set_postfix_str(name)
            results.append(_measure(name, cfg, iterations, lambda: bar.update(1)))
    summary = summarize(results)
    summary["workload"] = {"overrides": [*DEFAULT_OVERRIDES, *overrides], "iterations": iterations,
                           "env_steps_per_iteration": results[0].env_steps_per_iteration}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "results.md").write_text(markdown(summary))
        plot_timelines(results, out_dir / "timeline.png")
        summary["files"] = [str(out_dir / n) for n in ("results.json", "results.md", "timeline.png")]
    return summary


def _mean_result(name: str, runs: list[ModeResult]) -> ModeResult:
    fields = ("iter_time_s", "env_steps_per_s", "sim_s", "infer_s", "weight_sync_s")
    return ModeResult(name, *(sum(getattr(r, f) for r in runs) / len(runs) for f in fields))


def summarize(results: list[ModeResult]) -> dict:
    """Speedups against serial (the mean of its runs); the ideal bound from its stage times."""
    serial_runs = [r for r in results if r.name.startswith("serial")]
    pipelined = [r for r in results if not r.name.startswith("serial")]
    serial = _mean_result("serial colocated", serial_runs)
    ideal = (serial.sim_s + serial.infer_s) / max(serial.sim_s, serial.infer_s)
    best = min(pipelined, key=lambda r: r.iter_time_s)
    achieved = serial.iter_time_s / best.iter_time_s
    modes = []
    for r in results:
        row = {k: v for k, v in asdict(r).items() if k != "trace"}
        row["speedup"] = serial.iter_time_s / r.iter_time_s
        modes.append(row)
    return {
        "modes": modes,
        "sim_s": serial.sim_s,
        "infer_s": serial.infer_s,
        "sim_over_infer": serial.sim_s / serial.infer_s,
        "ideal_speedup": ideal,
        "best_mode": best.name,
        "achieved_speedup": achieved,
        "achieved_over_ideal": achieved / ideal,
    }


def markdown(summary: dict) -> str:
    lines = [
        "| mode | iteration (s) | env-steps/s | sim busy (s) | infer busy (s) | weight sync (ms) | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in summary["modes"]:
        lines.append(f"| {m['name']} | {m['iter_time_s']:.3f} | {m['env_steps_per_s']:.1f} | {m['sim_s']:.3f} | "
                     f"{m['infer_s']:.3f} | {m['weight_sync_s'] * 1e3:.1f} | {m['speedup']:.2f}x |")
    lines += [
        "",
        f"stage times (serial, mean of its two runs): sim {summary['sim_s']:.3f} s, infer {summary['infer_s']:.3f} s "
        f"(sim/infer {summary['sim_over_infer']:.2f})",
        f"ideal speedup (sim + infer) / max(sim, infer): {summary['ideal_speedup']:.2f}x",
        f"achieved speedup ({summary['best_mode']}): {summary['achieved_speedup']:.2f}x = "
        f"{summary['achieved_over_ideal']:.2f} of ideal",
    ]
    return "\n".join(lines) + "\n"


def plot_timelines(results: list[ModeResult], path: Path) -> None:
    """One panel per mode: a lane per worker, a bar per busy interval of its last iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sim": "tab:blue", "infer": "tab:orange", "weight sync": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.6 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        lanes = sorted({lane for lane, *_ in result.trace}, reverse=True)
        for y, lane in enumerate(lanes):
            for stage in colors:
                bars = [(s, e - s) for ln, st, s, e in result.trace if ln == lane and st == stage]
                if bars:
                    ax.broken_barh(bars, (y - 0.35, 0.7), color=colors[stage], label=stage)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_title(f"{result.name}: {result.iter_time_s:.2f} s per iteration", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="upper right", ncol=len(labels))
    axes[-1, 0].set_xlabel("seconds since the iteration started")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)
