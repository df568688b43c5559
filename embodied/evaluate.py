"""Evaluation results (success_once, success_at_end, return) as JSON and markdown, and videos.

Protocol (ManiSkill): each episode is reset with a recorded seed (``eval.seed + k``
for episode ``k``) and runs the task's full time limit, success or not
(terminations are ignored); ``success_once`` counts episodes successful at any
step, ``success_at_end`` those successful at their last step. Actions are the
policy's mean unless ``eval.deterministic=false``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from envs.video import VideoRecorder


def summarize(rows: list[dict], task: str) -> dict:
    """Aggregate per-episode rows into the eval summary written to eval.json."""
    n = len(rows)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / n if n else 0.0

    return {
        "task": task,
        "episodes": n,
        "success_once": mean("success_once"),
        "success_at_end": mean("success_at_end"),
        "return_mean": mean("return"),
        "episode_length_mean": mean("length"),
        "seeds": [r["seed"] for r in rows],
        "rows": rows,
    }


def markdown_table(summary: dict) -> str:
    head = "| task | episodes | success_once | success_at_end | return_mean |\n|---|---:|---:|---:|---:|\n"
    return head + (f"| {summary['task']} | {summary['episodes']} | {summary['success_once']:.3f} | "
                   f"{summary['success_at_end']:.3f} | {summary['return_mean']:.2f} |\n")


def write_eval(out_dir: Path, summary: dict) -> str:
    """Write ``eval.json`` and ``eval.md`` into ``out_dir``; returns the markdown table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=1))
    table = markdown_table(summary)
    (out_dir / "eval.md").write_text(table)
    return table


@torch.no_grad()
def record_videos(policy, env_cfg, episodes: int, seed: int, out_dir: Path,
                  deterministic: bool = True) -> list[Path]:
    """Record ``episodes`` full-length episodes (``policy=None``: uniform random actions).

    One mp4 per episode, ``<out_dir>/episode_<k>_seed_<s>.mp4``, rendered in this process.
    """
    from envs.registry import make_vec_env

    env = make_vec_env(env_cfg, num_envs=1, num_procs=0)
    env.set_ignore_terminations(True)
    paths = []
    generator = torch.Generator().manual_seed(seed)
    try:
        for k in range(episodes):
            episode_seed = seed + k
            obs, _ = env.reset(seed=episode_seed)
            video = VideoRecorder(out_dir / f"episode_{k}_seed_{episode_seed}.mp4")
            reward, success = None, False
            # frame t shows the scene after t steps; the env auto-resets after its last
            # step, so that final scene is not rendered
            for step in range(env.max_episode_steps):
                video.add(env.render(0), step=step, reward=reward, success=success)
                if policy is None:
                    actions = torch.rand(1, env.action_dim, generator=generator) * 2 - 1
                else:
                    actions = policy.act(obs, deterministic=deterministic)[0].clamp(-1, 1)
                result = env.step(actions)
                reward, success = float(result.reward[0]), bool(result.info["success"][0])
                obs = result.obs
            paths.append(video.save())
    finally:
        env.close()
    return paths

