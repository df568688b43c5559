"""What the reference parity tests share: the fixtures upstream's code built (assets/reference),
loading one as a user would, and observations built as an env gives them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embodied.config import compose
from envs.base import encode_instruction

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "reference"
OBS_SPEC = {"rgb": ((224, 224, 3), np.uint8), "wrist_rgb": ((224, 224, 3), np.uint8), "state": ((8,), np.float32)}


def outputs(name: str) -> dict[str, np.ndarray]:
    """What upstream computed on fixture ``name`` (``<case>/<quantity>`` keys)."""
    return dict(np.load(ASSETS / f"{name}_outputs.npz"))


def inputs() -> dict[str, np.ndarray]:
    """The frames, instructions and state every fixture was computed on (capture_inputs.py)."""
    return dict(np.load(ASSETS / "inputs.npz"))


def load_policy(config: str, model: str, *overrides: str, obs_spec: dict | None = None, action_dim: int = 7,
                unnorm_key: str = "libero_spatial_no_noops"):
    """``policy=<config> policy.model_path=assets/reference/<model>`` in float32, as a user loads it."""
    from policies.registry import make_policy

    cfg = compose([f"policy={config}", f"policy.model_path={ASSETS / model}", "policy.dtype=float32",
                   "policy.lora_rank=0", f"policy.unnorm_key={unnorm_key}", *overrides]).policy
    return make_policy(cfg, obs_spec or OBS_SPEC, action_dim).eval()


def observation(frames: list[np.ndarray], instruction: str, state: np.ndarray | None = None,
                cameras: tuple[str, ...] = ("rgb", "wrist_rgb")) -> dict:
    """A batch of one: ``frames`` under ``cameras``' keys, the instruction as an env encodes it."""
    obs = {camera: torch.from_numpy(np.ascontiguousarray(frame))[None]
           for camera, frame in zip(cameras, frames, strict=False)}
    obs["instruction"] = torch.from_numpy(encode_instruction(instruction))[None]
    if state is not None:
        obs["state"] = torch.from_numpy(state.astype(np.float32))[None]
    return obs
