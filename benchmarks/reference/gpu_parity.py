"""The reference parity comparisons on a CUDA device: each fixture's policy moved to the GPU, in
float32 against upstream's outputs (the tests' tolerances) and in bfloat16 (how far it drifts).

The CPU tests (tests/test_reference_parity.py, tests/test_reference_options.py) prove the
arithmetic; this checks that nothing in the loaders or the policies' forward passes keeps a
tensor on the CPU (statistics, masks, letterbox pixels, proprio) once the model is on a GPU.
The frames are the ones upstream's processor saw (the input adapters run on the CPU anyway).

Usage (a GPU machine, the repository root): ``python benchmarks/reference/gpu_parity.py [--out report.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.reference import load_policy, observation, outputs  # noqa: E402

ALOHA_CAMERAS = ("rgb", "left_wrist_rgb", "right_wrist_rgb")


def fixtures() -> list[dict]:
    """Each fixture: how to load it, its cases, and how to build a case's observation."""
    aloha_spec = {c: ((224, 224, 3), np.uint8) for c in ALOHA_CAMERAS} | {"state": ((14,), np.float32)}
    return [
        {"name": "openvla_tiny", "config": "openvla_7b_libero", "kind": "openvla", "logits": slice(31488, 32064),
         "cases": ["libero_raw", "libero_eval", "maniskill", "gradient"]},
        {"name": "openvla_single_tiny", "config": "openvla_7b_libero", "kind": "openvla",
         "logits": slice(31616, 32032), "unnorm_key": "libero_10_no_noops",
         "obs_spec": {"rgb": ((224, 224, 3), np.uint8)},
         "cases": ["libero_eval", "maniskill", "gradient", "gradient_odd", "long_instruction", "non_ascii"]},
        {"name": "openvla_oft_l1_tiny", "config": "openvla_oft_7b_libero", "kind": "l1", "chunk": (8, 7),
         "cases": ["libero_eval", "maniskill", "gradient"]},
        {"name": "openvla_oft_token_tiny", "config": "openvla_oft_7b_simplevla", "kind": "token",
         "cases": ["libero_eval", "maniskill", "gradient"]},
        {"name": "openvla_oft_aloha_tiny", "config": "openvla_oft_7b_aloha", "kind": "l1", "chunk": (25, 14),
         "unnorm_key": "aloha1_put_x_into_pot_300_demos", "obs_spec": aloha_spec, "action_dim": 14,
         "cameras": ALOHA_CAMERAS, "cases": ["aloha_libero_frames", "aloha_other_frames"]},
        {"name": "openvla_oft_proprio_mask_tiny", "config": "openvla_oft_7b_libero", "kind": "l1", "chunk": (8, 7),
         "overrides": ["policy.vla.cameras=[rgb]"], "cases": ["libero_eval", "maniskill", "gradient"]},
    ]


def case_obs(fixture: dict, ref: dict, case: str, device: torch.device) -> dict:
    if fixture["kind"] == "openvla":
        obs = observation([ref[f"{case}/image"]], str(ref[f"{case}/instruction"]))
    else:
        cameras = fixture.get("cameras", ("rgb", "wrist_rgb"))
        state = ref.get(f"{case}/state") if fixture["kind"] == "l1" else None
        obs = observation(list(ref[f"{case}/images"]), str(ref[f"{case}/instruction"]), state, cameras=cameras)
    return {k: v.to(device) for k, v in obs.items()}


@torch.no_grad()
def compare(fixture: dict, dtype: str, device: torch.device) -> dict[str, float]:
    """Largest differences from upstream's outputs over the fixture's cases (tokens: mismatches)."""
    policy = load_policy(fixture["config"], fixture["name"], f"policy.vla.dtype={dtype}", *fixture.get("overrides", []),
                         obs_spec=fixture.get("obs_spec"), action_dim=fixture.get("action_dim", 7),
                         unnorm_key=fixture.get("unnorm_key", "libero_spatial_no_noops")).to(device)
    policy.adapter = type(policy.adapter)(gripper=policy.adapter.gripper)  # the frames are upstream's, prepared
    ref, worst = outputs(fixture["name"]), {}

    def note(key: str, value: float) -> None:
        worst[key] = max(worst.get(key, 0.0), float(value))

    for case in fixture["cases"]:
        obs = case_obs(fixture, ref, case, device)
        pixels = policy._pixel_values(obs, device)[0].float().cpu().numpy()
        note("pixel_values", np.abs(pixels - ref[f"{case}/pixel_values"]).max())
        if fixture["kind"] == "openvla":
            bins, _, _ = policy.act(obs, deterministic=True)
            tokens = policy.actions.action_ids.to(device)[bins.long()][0]
            note("token_mismatches", (tokens.cpu().numpy() != ref[f"{case}/generated_ids"]).sum())
            logits, _, _ = policy._run(obs, tokens[None, :-1])
            kept = logits[0, -7:, fixture["logits"]].float().cpu().numpy()
            note("logits", np.abs(kept - ref[f"{case}/logits"]).max())
            note("actions", np.abs(policy.to_env(bins)[0].float().cpu().numpy() - ref[f"{case}/env_action"]).max())
            continue
        _, hidden, _ = policy._forward(obs)
        note("hidden_states", np.abs(hidden[0].float().cpu().numpy() - ref[f"{case}/actions_hidden_states"]).max())
        chunk, _, _ = policy.act(obs, deterministic=True)
        if fixture["kind"] == "l1":
            if policy.proprio_stats is not None:
                proprio = policy._proprio(obs["state"].double())[0].cpu().numpy()
                note("proprio", np.abs(proprio - ref[f"{case}/proprio"]).max())
            actions = policy.actions.unnormalize(chunk.unflatten(-1, fixture["chunk"]).float().cpu())[0].numpy()
            note("actions", np.abs(actions - ref[f"{case}/actions"]).max())
        else:
            tokens = policy.actions.action_ids.to(device)[chunk.long()][0]
            note("token_mismatches", (tokens.cpu().numpy() != ref[f"{case}/predicted_ids"]).sum())
    return worst


TOLERANCES = {"pixel_values": 1e-6, "logits": 1e-5, "hidden_states": 1e-5, "proprio": 1e-6, "actions": 1e-5,
              "token_mismatches": 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the report as JSON here too")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report, failed = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, []
    for fixture in fixtures():
        for dtype in ("float32", "bfloat16"):
            try:
                worst = compare(fixture, dtype, device)
            except Exception as err:  # a device mismatch is what this looks for: report it, go on
                worst = {"error": f"{type(err).__name__}: {err}"}
            report[f"{fixture['name']}/{dtype}"] = worst
            if dtype == "float32" and ("error" in worst or any(v > TOLERANCES[k] for k, v in worst.items())):
                failed.append(fixture["name"])
            print(f"{fixture['name']:32s} {dtype:9s} {json.dumps(worst)}", flush=True)
    print(f"float32 within the CPU tests' tolerances on {report['device']}: "
          f"{'all' if not failed else 'NOT ' + ', '.join(failed)}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
