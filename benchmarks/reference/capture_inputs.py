"""Capture the fixed inputs the reference parity fixtures are computed on (run in the project's venv).

Writes ``assets/reference/inputs.npz``: real frames from the simulators this project runs, as
uint8 ``[H, W, 3]`` arrays, plus the instructions and a LIBERO proprio state:

- ``libero_agentview`` / ``libero_wrist``: libero_spatial task 0, stored init state 0, after the
  settle steps, 256 x 256 (the resolution OpenVLA's and OFT's LIBERO eval scripts render at),
  upright as :class:`envs.libero.LiberoEnv` returns them; ``libero_state`` ``[8]``;
- ``maniskill_rgb``: PushCube-v1's 128 x 128 base camera after a seeded reset;
- ``gradient``: a synthetic 180 x 240 (non-square, not 224) image.

Usage: ``.venv/bin/python benchmarks/reference/capture_inputs.py``
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "assets" / "reference" / "inputs.npz"


def libero_frames() -> dict[str, np.ndarray]:
    os.environ.setdefault("MUJOCO_GL", "egl")
    from envs.libero import LiberoEnv, LiberoSpec, episode_seed, suite_tasks

    env = LiberoEnv(LiberoSpec("libero_spatial", image_size=256, max_episode_steps=10))
    obs = env.reset(episode_seed(0, 0))
    return {"libero_agentview": obs["rgb"], "libero_wrist": obs["wrist_rgb"],
            "libero_state": obs["state"].astype(np.float32),
            "libero_instruction": np.array(suite_tasks("libero_spatial")[0].instruction)}


def maniskill_frame() -> dict[str, np.ndarray]:
    from envs.maniskill import ManiSkillCPUEnv, ManiSkillSpec, instruction_for

    spec = ManiSkillSpec("PushCube-v1", "rgb", "pd_joint_delta_pos", "normalized_dense", 50, 128, 128, "cpu")
    env = ManiSkillCPUEnv(spec)
    obs = env.reset(seed=7)
    rgb = np.asarray(obs["rgb"])
    env.close()
    return {"maniskill_rgb": rgb.reshape(rgb.shape[-3:]).astype(np.uint8),
            "maniskill_instruction": np.array(instruction_for("PushCube-v1"))}


def gradient() -> np.ndarray:
    y, x = np.mgrid[0:180, 0:240]
    return np.stack([x * 255 // 239, y * 255 // 179, (x + y) * 255 // 418], axis=-1).astype(np.uint8)


def main() -> None:
    arrays = {**libero_frames(), **maniskill_frame(), "gradient": gradient()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    for key, value in arrays.items():
        print(f"{key}: {value.dtype} {value.shape}")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
