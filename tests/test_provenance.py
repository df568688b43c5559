"""What an evaluation records about the weights it evaluated (embodied/provenance.py)."""

import shutil
from pathlib import Path

from embodied.config import compose
from embodied.provenance import digest, model_files, provenance

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "reference" / "openvla_oft_l1_tiny"


def test_the_weights_digest_names_the_bytes_not_the_place(tmp_path):
    """A copy of a model directory has the digest of the original; one changed byte in a weight,
    component, tokenizer or statistics file gives another; files that are not the policy (a README)
    do not count."""
    copy = Path(shutil.copytree(FIXTURE, tmp_path / "copy"))
    assert digest(model_files(copy)) == digest(model_files(FIXTURE))
    (copy / "README.md").write_text("notes")
    assert digest(model_files(copy)) == digest(model_files(FIXTURE))
    names = {p.name for p in model_files(copy)}
    assert {"model.safetensors", "config.json", "action_head--100_checkpoint.pt", "dataset_statistics.json",
            "tokenizer.json", "tokenizer.model"} <= names
    head = copy / "action_head--100_checkpoint.pt"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    assert digest(model_files(copy)) != digest(model_files(FIXTURE))


def test_provenance_names_the_model_and_the_settings_that_change_what_it_sees():
    cfg = compose(["env=libero_spatial", "policy=openvla_oft_7b_libero", f"policy.vla.model_path={FIXTURE}",
                   "eval.trials_per_task=7"])
    what = provenance(cfg, None)
    assert what["weights"]["model_path"] == str(FIXTURE) and len(what["weights"]["model_sha256"]) == 64
    settings = what["settings"]
    assert settings["cameras"] == ["rgb", "wrist_rgb"] and settings["center_crop"] == 0.9
    assert settings["trials_per_task"] == 7 and settings["normalization"] == "bounds_q99"


def test_a_pi0_evaluation_records_the_steps_and_what_the_checkpoint_records_beside_the_runs_values():
    """The Euler steps, the executed actions, the image size and the prompt length: each the run's value beside
    the checkpoint's config.json field, so an override shows."""
    ckpt = FIXTURE.parent / "pi0_tiny_odd"
    what = provenance(compose(["policy=pi0_tiny", f"policy.path={ckpt}", "policy.flow.eval_steps=10"]), None)
    assert what["settings"]["flow"]["eval_steps"] == 10 and what["settings"]["pi"]["image_size"] == 100
    recorded = what["settings"]["checkpoint_settings"]
    assert recorded["policy.flow.eval_steps"] == {"value": 10, "checkpoint": 4, "field": "num_inference_steps"}
    assert recorded["policy.chunk_size"] == {"value": 5, "checkpoint": 5, "field": "n_action_steps"}
    assert recorded["policy.vla.dtype"] == {"value": "float32", "checkpoint": "float32", "field": "dtype"}
    assert {p.name for p in model_files(ckpt)} >= {"policy_preprocessor.json", "tiny_overrides.json",
                                                   "tokenizer.json", "model.safetensors"}
