"""A lerobot checkpoint acts with our defaults as lerobot's ``select_action`` does, whatever its settings.

The fixtures ``pi0_tiny_odd`` / ``pi05_tiny_odd`` (benchmarks/reference/pi0_odd_fixtures.py) were built and run by
lerobot 0.6.1's own code with every setting unlike lerobot's defaults and our other fixtures: cameras of 120x160,
112x112 and 77x53 frames (pi0.5: 96x128, 50x70 and an empty slot), 100 px images with patches of 16 (pi0.5: 64 px),
chunks of 7 of which 5 are executed, 4 and 5 Euler steps, state 9 and action 6 padded to 20 / 24, prompt lengths 23
and 40, other time-embedding periods, quantile statistics on pi0 and mean/std on pi0.5 (each the other's default),
a tokenizer saved in the directory, instructions with digits, punctuation, ``_`` and ``\\n``. lerobot's run: its
pre-processor, ``select_action`` seven times in a row (a chunk at calls 0 and 5), its post-processor. Here only the
checkpoint's directory is given (and the env's camera keys): the rest is read from it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied.config import compose
from envs.base import encode_instructions
from policies.registry import check_policy_config, make_policy
from tests.reference import ASSETS

# float32 on both sides; what is left is the order of float32 sums in the two implementations (the network is
# bit-exact against lerobot's on the other fixtures), far inside this bound on actions of magnitude ~1
TOL = dict(rtol=1e-4, atol=1e-4)
CASES = {"pi0_tiny_odd": "pi0_tiny", "pi05_tiny_odd": "pi05_tiny"}


def _policy(name: str):
    ref = dict(np.load(ASSETS / f"{name}_outputs.npz"))
    cameras = [str(c).removeprefix("observation.images.") for c in ref["cameras"]]
    cfg = compose([f"policy={CASES[name]}", f"policy.path={ASSETS / name}",
                   f"policy.vla.cameras=[{','.join(cameras)}]"])
    notes = check_policy_config(cfg.policy, ref["actions"].shape[-1])
    obs = _observation(ref, cameras, 0)
    spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()}
    return make_policy(cfg.policy, spec, ref["actions"].shape[-1]).eval(), cfg.policy, ref, cameras, notes


def _observation(ref: dict, cameras: list[str], call: int) -> dict[str, torch.Tensor]:
    obs = {c: torch.from_numpy(ref[f"frames_{c}"][call]) for c in cameras}
    obs["state"] = torch.from_numpy(ref["state"][call])
    obs["instruction"] = torch.from_numpy(encode_instructions([str(t) for t in ref["tasks"]]))
    return obs


@pytest.mark.parametrize("name", list(CASES))
def test_the_checkpoints_own_settings_are_the_defaults(name):
    import json

    config = json.loads((ASSETS / name / "config.json").read_text())
    _, cfg, _, _, notes = _policy(name)
    assert (cfg.chunk_size, cfg.flow.eval_steps, cfg.pi.image_size, cfg.pi.max_tokens) == (
        config["n_action_steps"], config["num_inference_steps"], config["image_resolution"][0],
        config["tokenizer_max_length"])
    assert any(f"num_inference_steps={config['num_inference_steps']}" in n for n in notes), notes
    assert not any("overrides" in n for n in notes), notes


@pytest.mark.parametrize("name", list(CASES))
def test_the_prompts_tokens_and_images_are_lerobots(name):
    policy, _, ref, cameras, _ = _policy(name)
    obs = _observation(ref, cameras, 0)
    state = policy.state_norm.normalize(obs["state"].float()) if policy.state_norm else obs["state"]
    torch.testing.assert_close(state, torch.from_numpy(ref["state_norm"][0]), rtol=1e-6, atol=1e-6)
    prompts = policy._prompts(obs, state)
    assert prompts == [str(p) for p in ref["prompts"][0]]
    tokens, mask = policy._tokens(prompts, torch.device("cpu"))
    assert torch.equal(tokens, torch.from_numpy(ref["tokens"][0])) and torch.equal(mask, torch.from_numpy(
        ref["token_mask"][0]))


@pytest.mark.parametrize("name", list(CASES))
def test_seven_calls_act_as_lerobots_select_action(name):
    """Each chunk from lerobot's noise; the env executes its first ``n_action_steps`` open loop, as lerobot's
    action queue hands them out one call at a time."""
    policy, cfg, ref, cameras, _ = _policy(name)
    calls = len(ref["actions"])
    for chunk, start in enumerate(int(c) for c in ref["chunk_calls"]):
        noise = torch.zeros(len(ref["state"][start]), policy.noise_dim)
        noise[:, :policy.width] = torch.from_numpy(ref["noise"][chunk]).flatten(1)
        with torch.no_grad():
            obs = _observation(ref, cameras, start)
            actions = policy.to_env(policy.act(obs, deterministic=True, noise=noise)[0], obs)  # [B, chunk_size, A]
        executed = min(cfg.chunk_size, calls - start)
        theirs = torch.from_numpy(ref["actions"][start:start + executed]).transpose(0, 1)
        torch.testing.assert_close(actions[:, :executed], theirs, **TOL)
