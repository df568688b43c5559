"""Evaluation results (success_once, success_at_end, return), per task, as JSON and markdown; videos.

Protocol: every episode is named by a seed from the env backend's
:class:`~envs.registry.SeedScheme` (ManiSkill: ``eval.seed + k`` for episode ``k``;
LIBERO: each task's first ``eval.trials_per_task`` stored init states, see
docs/libero_protocol.md), runs exactly once, and runs the task's full time limit,
success or not (terminations are ignored); ``success_once`` counts episodes
successful at any step, ``success_at_end`` those successful at their last step.
Actions are the policy's mean unless ``eval.deterministic=false``.

Success rates carry a 95% Wilson interval, and :func:`paired_gain` compares two
checkpoints on the same seeds: a gain a table reports is read with its uncertainty.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from embodied.checkpoint import atomic_write
from envs.registry import seed_scheme
from envs.video import VideoRecorder

Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(successes: int, episodes: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a success rate: unlike the normal approximation it stays
    inside [0, 1] and is not zero-width at 0 or all successes. ``(0, 1)`` for no episodes."""
    if episodes == 0:
        return 0.0, 1.0
    p, n = successes / episodes, episodes
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0 or all successes the bound is exactly 0 or 1; floating point would leave a 1e-17
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == episodes else min(1.0, centre + half)
    return lo, hi


def paired_gain(before: list[dict], after: list[dict], key: str = "success_once") -> dict:
    """``after`` minus ``before`` over the same seeds, with a 95% interval from the per-seed
    differences (a paired comparison: the seeds' own difficulty cancels out).

    Returns ``{"gain", "ci95": [lo, hi], "episodes", "improved", "worsened"}`` (rates, not points).
    """
    first = {r["seed"]: float(r[key]) for r in before}
    second = {r["seed"]: float(r[key]) for r in after}
    if set(first) != set(second) or not first:
        raise ValueError(f"paired_gain needs the same non-empty seeds on both sides; {len(set(first) ^ set(second))} "
                         "seeds are in only one of them. Evaluate both checkpoints with the same eval.seed and "
                         "eval.episodes.")
    diffs = [second[s] - first[s] for s in first]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n)
    return {"gain": mean, "ci95": [mean - half, mean + half], "episodes": n,
            "improved": sum(d > 0 for d in diffs), "worsened": sum(d < 0 for d in diffs)}


def _means(rows: list[dict]) -> dict:
    n = len(rows)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / n if n else 0.0

    return {
        "episodes": n,
        "success_once": mean("success_once"),
        "success_once_ci95": list(wilson_interval(sum(bool(r["success_once"]) for r in rows), n)),
        "success_at_end": mean("success_at_end"),
        "return_mean": mean("return"),
        "episode_length_mean": mean("length"),
        "errors": sum(bool(r.get("error")) for r in rows),  # episodes ended by a crashed env process
    }


def per_task(rows: list[dict], env_cfg) -> list[dict]:
    """One summary per task, in task order (the seed scheme names each episode's task)."""
    scheme = seed_scheme(env_cfg)
    by_task: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        by_task.setdefault(scheme.task_of(env_cfg, row["seed"]), []).append(row)
    return [{"task_index": index, "task": name, **_means(task_rows)}
            for (index, name), task_rows in sorted(by_task.items())]


def summarize(rows: list[dict], env_cfg, task_subset: list[int] | None = None) -> dict:
    """Aggregate per-episode rows into the eval summary written to eval.json.

    ``tasks`` holds one row per task; ``suite_mean`` is the mean of the per-task
    ``success_once`` (equal to the overall rate when every task ran as many trials).
    ``task_subset``: the ``eval.tasks`` that ran, when not the whole suite.
    """
    tasks = per_task(rows, env_cfg)
    return {
        "task": env_cfg.task,
        **_means(rows),
        "suite_mean": sum(t["success_once"] for t in tasks) / len(tasks) if tasks else 0.0,
        "task_subset": None if task_subset is None else sorted(set(task_subset)),
        "tasks": tasks,
        "seeds": [r["seed"] for r in rows],
        "rows": rows,
    }


def markdown_table(summary: dict) -> str:
    """One row per task (when there are several), then the whole suite."""
    head = ("| task | episodes | success_once | 95% interval | success_at_end | return_mean |\n"
            "|---|---:|---:|---:|---:|---:|\n")

    def line(name: str, s: dict) -> str:
        lo, hi = s["success_once_ci95"]
        return (f"| {name} | {s['episodes']} | {s['success_once']:.3f} | {lo:.3f}-{hi:.3f} | "
                f"{s['success_at_end']:.3f} | {s['return_mean']:.2f} |\n")

    tasks = summary.get("tasks", [])
    body = "".join(line(f"{t['task_index']}: {t['task']}", t) for t in tasks) if len(tasks) > 1 else ""
    total = line(f"**{summary['task']}**" if body else summary["task"], summary)
    footer = f"\nsuite mean (per-task success_once averaged): {summary['suite_mean']:.3f}\n" if body else ""
    if summary.get("task_subset") is not None:
        footer += (f"\nOnly tasks {', '.join(map(str, summary['task_subset']))} ran (eval.tasks): "
                   "not the published whole-suite protocol.\n")
    if summary.get("errors"):
        footer += f"\n{summary['errors']} episode(s) ended failed-by-error (an env process crashed or hung).\n"
    return head + body + total + footer


def write_eval(out_dir: Path, summary: dict) -> str:
    """Write ``eval.json`` and ``eval.md`` into ``out_dir``; returns the markdown table."""
    table = markdown_table(summary)
    atomic_write(out_dir / "eval.json", lambda f: f.write(json.dumps(summary, indent=1).encode()))
    atomic_write(out_dir / "eval.md", lambda f: f.write(table.encode()))
    return table


def video_episodes(seeds: list[int], env_cfg, per_task: int) -> set[int]:
    """Indices of each task's first ``per_task`` episodes in ``seeds``."""
    scheme, taken, chosen = seed_scheme(env_cfg), {}, set()
    for k, seed in enumerate(seeds):
        task = scheme.task_of(env_cfg, seed)
        if taken.get(task, 0) < per_task:
            taken[task] = taken.get(task, 0) + 1
            chosen.add(k)
    return chosen


def write_episode_video(path: Path, video: dict, caption: str = "", min_height: int = 256) -> Path:
    """Write frames recorded during an eval (``EnvWorker.evaluate``) as an annotated mp4.

    Small camera images are scaled up by a whole factor (nearest pixel) so the text fits.
    """
    frames = video["frames"]
    scale = max(1, -(-min_height // frames.shape[1]))
    recorder = VideoRecorder(path)
    for step, (frame, reward, success) in enumerate(zip(frames, video["rewards"], video["successes"], strict=True)):
        big = np.repeat(np.repeat(frame, scale, axis=0), scale, axis=1)
        recorder.add(big, step=step, reward=reward, success=success, caption=caption)
    return recorder.save()


def recording_episodes(seeds: list[int], env_cfg, count: int) -> list[int]:
    """Indices of ``count`` of the protocol's ``seeds`` to film: each task's first episode first
    (LIBERO's first tasks' first init states), then the protocol's order (ManiSkill: eval.seed + k)."""
    firsts = video_episodes(seeds, env_cfg, per_task=1)
    return (sorted(firsts) + [k for k in range(len(seeds)) if k not in firsts])[:count]


def write_videos(out_dir: Path, videos: dict[int, dict], rows: list[dict], env_cfg) -> list[Path]:
    """Every video an evaluation recorded (episode index -> :meth:`EnvWorker.evaluate`'s frames),
    as ``<out_dir>/task_<t>_episode_<k>_seed_<s>.mp4`` captioned with its task; ``rows[k]`` is
    episode ``k``'s row. The one video writer of ``eval``, ``train`` and ``record``."""
    scheme, paths = seed_scheme(env_cfg), []
    for k, video in sorted(videos.items()):
        seed = rows[k]["seed"]
        index, name = scheme.task_of(env_cfg, seed)
        paths.append(write_episode_video(out_dir / f"task_{index:03d}_episode_{k}_seed_{seed}.mp4", video,
                                         caption=name.replace("_", " ")))
    return paths
