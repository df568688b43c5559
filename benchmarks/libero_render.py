"""LIBERO env-steps/s with ``env.rendering=fast`` and ``env.rendering=reference``, side by side in one process.

    .venv/bin/python benchmarks/libero_render.py [--suite libero_spatial] [--task 0] [--sizes 256 128]
                                                 [--steps 60] [--rounds 3] [--json]

For each camera size it builds one :class:`~envs.libero.LiberoEnv` per rendering (agentview + wrist
cameras, ``obs_mode=rgb``) on the same task and init state, takes ``WARMUP_STEPS`` steps in each, then
times ``--steps`` steps of each from the same seeded uniformly random actions, in ``--rounds``
alternating slices (fast, reference, fast, ...), so load from other processes falls on both alike.
The physics is identical (same state, same actions); only the rendering differs. Reported:
env-steps/s per rendering and the ratio fast / reference. One env, no worker processes: what an env
process of ``make_vec_env`` does per step, without the pipe.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from envs.libero import RENDERINGS, LiberoEnv, LiberoSpec, episode_seed

WARMUP_STEPS = 5


def _actions(steps: int) -> np.ndarray:
    """[steps, 7] uniform in [-1, 1], the same for every rendering."""
    return np.random.default_rng(0).uniform(-1.0, 1.0, (steps, 7))


def _make_current(env: LiberoEnv) -> None:
    """robosuite makes an env's EGL context current only when it creates it, never before rendering: with
    two envs in a process, the older one would render into the newer one's context (wrong frames, and
    misleading speeds). The project never has two (one env per process); this benchmark does."""
    env.env.sim._render_context_offscreen.gl_ctx.make_current()


def measure(suite: str, task: int, size: int, steps: int, rounds: int) -> list[dict]:
    """One row per rendering: timed steps, seconds, env-steps/s."""
    envs = {r: LiberoEnv(LiberoSpec(suite, size, max_episode_steps=10**6, rendering=r)) for r in RENDERINGS}
    seconds = dict.fromkeys(RENDERINGS, 0.0)
    try:
        for env in envs.values():
            _make_current(env)
            env.reset(episode_seed(task, 0))
            for action in _actions(WARMUP_STEPS):
                env.step(action)
        for chunk in np.array_split(_actions(steps), rounds):
            for rendering, env in envs.items():
                _make_current(env)
                t0 = time.perf_counter()
                for action in chunk:
                    env.step(action)
                seconds[rendering] += time.perf_counter() - t0
    finally:
        for env in envs.values():
            env.close()
    return [{"image_size": size, "rendering": r, "steps": steps, "seconds": seconds[r],
             "env_steps_per_s": steps / seconds[r]} for r in RENDERINGS]


def markdown(rows: list[dict]) -> str:
    rate = {(r["image_size"], r["rendering"]): r["env_steps_per_s"] for r in rows}
    lines = ["| camera px | rendering | steps | seconds | env-steps/s | fast / reference |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = rate[r["image_size"], "fast"] / rate[r["image_size"], "reference"]
        lines.append(f"| {r['image_size']} | {r['rendering']} | {r['steps']} | {r['seconds']:.1f} | "
                     f"{r['env_steps_per_s']:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 128],
                        help="camera px (256: the public checkpoints' authors')")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per rendering and size")
    parser.add_argument("--rounds", type=int, default=3, help="alternating slices the timed steps are cut into")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [row for size in args.sizes for row in measure(args.suite, args.task, size, args.steps, args.rounds)]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
