"""What the reference parity tests share: the fixtures upstream's code built (assets/reference),
loading one as a user would, and observations built as an env gives them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.base import encode_instruction

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "reference"
OBS_SPEC = {"rgb": ((224, 224, 3), np.uint8), "wrist_rgb": ((224, 224, 3), np.uint8), "state": ((8,), np.float32)}


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Loading a fixture must never reach for a hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():
        yield


def outputs(name: str) -> dict[str, np.ndarray]:
    """What upstream computed on fixture ``name`` (``<case>/<quantity>`` keys)."""
    return dict(np.load(ASSETS / f"{name}_outputs.npz"))


def inputs() -> dict[str, np.ndarray]:
    """The frames, instructions and state every fixture was computed on (capture_inputs.py)."""
    return dict(np.load(ASSETS / "inputs.npz"))


def load_policy(config: str, model: str, *overrides: str, obs_spec: dict | None = None, action_dim: int = 7,
                unnorm_key: str = "libero_spatial_no_noops"):
    """``policy=<config> policy.vla.model_path=assets/reference/<model>`` in float32, as a user loads it."""
    from policies.registry import make_policy

    cfg = compose([f"policy={config}", f"policy.vla.model_path={ASSETS / model}", "policy.vla.dtype=float32",
                   "policy.vla.lora_rank=0", f"policy.vla.unnorm_key={unnorm_key}", *overrides]).policy
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


def l1_oft_matches_upstream(policy, obs: dict, ref: dict, case: str) -> tuple[torch.Tensor, np.ndarray]:
    """The comparisons every L1 OFT fixture shares, on frames upstream's eval script already prepared
    (the family's frame steps bypassed, its gripper step kept): pixel values (1e-6), the normalised
    proprio (1e-6) and the hidden states at the action positions (1e-5). Returns the regressed chunk
    ``[1, T]`` (normalised) and what the env is sent ``[chunk, A]``."""
    saved, policy.adapter = policy.adapter, type(policy.adapter)(gripper=policy.adapter.gripper)
    try:
        np.testing.assert_allclose(policy._pixel_values(obs, "cpu")[0].numpy(), ref[f"{case}/pixel_values"],
                                   rtol=0, atol=1e-6)
        np.testing.assert_allclose(policy._proprio(obs["state"].double())[0].numpy(), ref[f"{case}/proprio"],
                                   rtol=0, atol=1e-6)
        _, hidden, _ = policy._forward(obs)
        np.testing.assert_allclose(hidden[0].numpy(), ref[f"{case}/actions_hidden_states"], rtol=0, atol=1e-5)
        chunk, _, _ = policy.act(obs, deterministic=True)
        return chunk, policy.to_env(chunk)[0].numpy()
    finally:
        policy.adapter = saved


def openvla_matches_upstream(policy, ref: dict, case: str, logit_ids: slice) -> None:
    """What every OpenVLA fixture case asserts against upstream's ``predict_action``: pixel values
    (1e-6), prompt ids with the appended 29871 piece (identical), greedy tokens (identical),
    teacher-forced logits over ``logit_ids`` (1e-5), actions and env actions (1e-6)."""
    obs = observation([ref[f"{case}/image"]], str(ref[f"{case}/instruction"]))
    np.testing.assert_allclose(policy._pixel_values(obs, "cpu")[0].numpy(), ref[f"{case}/pixel_values"], rtol=0,
                               atol=1e-6)
    ids, _ = policy._prompt_ids(obs)
    assert ids[0].tolist() == [*ref[f"{case}/input_ids"].tolist(), 29871]  # predict_action's appended piece
    bins, _, _ = policy.act(obs, deterministic=True)
    tokens = policy.actions.action_ids[bins.long()][0]
    assert tokens.tolist() == ref[f"{case}/generated_ids"].tolist()
    logits, _, _ = policy._run(obs, tokens[None, :-1])
    dims = tokens.shape[0]
    np.testing.assert_allclose(logits[0, -dims:, logit_ids].numpy(), ref[f"{case}/logits"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(policy.actions.decode(tokens).numpy(), ref[f"{case}/action"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(policy.to_env(bins)[0].numpy(), ref[f"{case}/env_action"], rtol=0, atol=1e-6)
