"""A checkpoint that cannot work is refused before anything starts: copies of the shipped OpenVLA /
OpenVLA-OFT fixtures (assets/reference/), each with one thing broken, make ``embodied eval`` (and
``embodied train``) exit 2 with one paragraph naming the file and the field, before Ray starts.

Through the CLI's ``main`` in this process (a process per case would cost ~8 s of imports each);
one case runs as a user would, in its own process, within 60 s.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from envs.common import UserError
from tests.conftest import run_cli

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "reference"
WEIGHTS = "model.safetensors"
# the tiny policy configs on a checkpoint directory: its 224 px images, one of its datasets' statistics
CHECKPOINT_RUN = ["env=libero_spatial", "policy.vla.image_size=224", "policy.vla.dtype=float32",
                  "eval.trials_per_task=1"]
POLICIES = {"openvla_tiny": ["policy=openvla_tiny", "policy.vla.unnorm_key=libero_spatial_no_noops"],
            "openvla_oft_l1_tiny": ["policy=openvla_oft_tiny", "policy.vla.unnorm_key=libero_spatial_no_noops"],
            "openvla_single_tiny": ["policy=openvla_tiny", "policy.vla.unnorm_key=libero_10_no_noops"]}


def _config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit of a checkpoint copy's config.json."""
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        change(config)
        (model / "config.json").write_text(json.dumps(config, indent=1))
    return edit


def _weights(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    """An edit of a checkpoint copy's tensors (model.safetensors rewritten whole)."""
    def edit(model: Path) -> None:
        tensors = load_file(model / WEIGHTS)
        change(tensors)
        save_file(tensors, str(model / WEIGHTS), metadata={"format": "pt"})
    return edit


def _drop_layer(tensors: dict[str, torch.Tensor]) -> None:
    for name in [n for n in tensors if n.startswith("language_model.model.layers.1.")]:
        del tensors[name]


def _fused_projector_layer(tensors: dict[str, torch.Tensor]) -> None:
    """fc3: the third projector layer of a fused (two-ViT) checkpoint, in a single-ViT one."""
    tensors["projector.fc3.weight"], tensors["projector.fc3.bias"] = torch.zeros(32, 32), torch.zeros(32)


def _truncate(model: Path) -> None:
    data = (model / WEIGHTS).read_bytes()
    (model / WEIGHTS).write_bytes(data[:len(data) // 2])  # an interrupted download


CASES = {  # the fixture, one thing broken in a copy of it, words the one paragraph must have
    "unknown activation": ("openvla_tiny", _config(lambda c: c["text_config"].update(hidden_act="swishy")),
                           ["config.json", "text_config.hidden_act", "'swishy'", "ACT2FN", "silu"]),
    "unknown vision backbone id": (
        "openvla_single_tiny", _config(lambda c: c.update(vision_backbone_id="siglip-vit-so400m-999px")),
        ["config.json", "vision_backbone_id", "'siglip-vit-so400m-999px'", "'siglip-vit-so400m-384px'"]),
    "heads that do not divide the width": (
        "openvla_oft_l1_tiny", _config(lambda c: c["timm_overrides"][1].update(num_heads=5)),
        ["config.json", "timm_overrides for vit_so400m_patch14_siglip_224", "num_heads=5", "embed_dim=48"]),
    "widths unlike the weights": (
        "openvla_tiny", _config(lambda c: c["text_config"].update(intermediate_size=48)),
        [WEIGHTS, "6 weight(s) have other shapes", "mlp.down_proj.weight: (16, 32) in the file, (16, 48) per the "
         "config", "text_config.intermediate_size=48", "copy both from one checkpoint"]),
    "missing weights": ("openvla_oft_l1_tiny", _weights(_drop_layer),
                        [WEIGHTS, "9 weight(s) the network has are missing", "language_model.model.layers.1."]),
    "extra weights": ("openvla_single_tiny", _weights(_fused_projector_layer),
                      [WEIGHTS, "2 weight(s) in it are not the network's", "projector.fc3.bias"]),
    "wrong dtype field": ("openvla_tiny", _config(lambda c: c.update(torch_dtype="bf16")),
                          ["config.json", "torch_dtype='bf16'", "floating-point dtype", "bfloat16"]),
    "truncated safetensors file": ("openvla_oft_l1_tiny", _truncate,
                                   [WEIGHTS, "truncated", "Download it again"]),
}


def _broken_copy(name: str, tmp_path: Path) -> Path:
    fixture, edit, _ = CASES[name]
    model = Path(shutil.copytree(ASSETS / fixture, tmp_path / fixture))
    edit(model)
    return model


def _command(command: str, fixture: str, model: Path) -> list[str]:
    return [command, *POLICIES[fixture], f"policy.vla.model_path={model}", *CHECKPOINT_RUN]


class RayStarted(Exception):
    """What the patched ``start_cluster`` raises: the command got past every check."""


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray raises :class:`RayStarted` (a refusal must come before it)."""
    import embodied.runner

    def refuse(*args, **kwargs):
        raise RayStarted

    monkeypatch.setattr(embodied.runner, "start_cluster", refuse)


def _assert_refused(code: int, stderr: str, words: list[str]) -> None:
    import ray

    assert not ray.is_initialized()
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr  # one paragraph, nothing else
    missing = [word for word in words if word not in stderr]
    assert not missing, (missing, stderr)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_broken_checkpoint_is_refused_before_ray_starts(name, tmp_path, no_ray, capsys):
    from embodied.cli import main

    model = _broken_copy(name, tmp_path)
    code = main(_command("eval", CASES[name][0], model))
    _assert_refused(code, capsys.readouterr().err, CASES[name][2])


@pytest.mark.parametrize("fixture", sorted(POLICIES))
def test_the_unbroken_fixtures_pass_every_check(fixture, no_ray, capsys):
    """The control: the same command on the fixture itself gets as far as starting Ray."""
    from embodied.cli import main

    with pytest.raises(RayStarted):
        main(_command("eval", fixture, ASSETS / fixture))
    assert "error" not in capsys.readouterr().err


def test_train_refuses_a_broken_checkpoint_the_same_way(tmp_path, no_ray, capsys):
    """``embodied train`` checks the policy through the same ``check_policy_config`` (``start_workers``)."""
    from embodied.cli import main

    model = _broken_copy("widths unlike the weights", tmp_path)
    code = main(_command("train", "openvla_tiny", model))
    _assert_refused(code, capsys.readouterr().err, CASES["widths unlike the weights"][2])


def test_a_real_process_refuses_a_truncated_download_within_a_minute(tmp_path):
    """As a user meets it: exit 2, one paragraph, no traceback, no Ray, well within 60 s."""
    name = "truncated safetensors file"
    started = time.perf_counter()
    proc = run_cli(*_command("eval", CASES[name][0], _broken_copy(name, tmp_path)), timeout=60)
    assert time.perf_counter() - started < 60
    assert "Started a local Ray instance" not in proc.stderr and "start-up:" not in proc.stderr
    _assert_refused(proc.returncode, proc.stderr, CASES[name][2])


def test_a_truncated_oft_component_file_is_refused_naming_it(tmp_path):
    from embodied.config import compose
    from policies.registry import check_policy_config

    model = Path(shutil.copytree(ASSETS / "openvla_oft_l1_tiny", tmp_path / "oft"))
    head = model / "action_head--100_checkpoint.pt"
    head.write_bytes(head.read_bytes()[:2000])
    cfg = compose([*POLICIES["openvla_oft_l1_tiny"], f"policy.vla.model_path={model}", *CHECKPOINT_RUN])
    with pytest.raises(UserError) as err:
        check_policy_config(cfg.policy, 7)
    assert str(head) in str(err.value) and "truncated or damaged" in str(err.value)


# -- Qwen2.5-VL: no shipped fixture; a tiny model saved by the policy itself ------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from embodied.config import compose
    from policies.registry import make_policy

    path = tmp_path_factory.mktemp("qwen") / "qwen_vl_tiny"
    torch.manual_seed(0)
    make_policy(compose(["policy=qwen_vl_tiny"]).policy, {"rgb": ((64, 64, 3), torch.uint8)}, 7).save_pretrained(path)
    return path


def _check_qwen(model: Path) -> None:
    from embodied.config import compose
    from policies.registry import check_policy_config

    check_policy_config(compose(["policy=qwen_vl_tiny", f"policy.vla.model_path={model}"]).policy, 7)


def _module_names(model: Path) -> None:
    """The weights under the module names of transformers 5's class (``model.language_model.*``,
    ``model.visual.*``) instead of the hub layout the policy saves (``model.*``, ``visual.*``)."""
    _weights(lambda tensors: tensors.update({_module_name(n): tensors.pop(n) for n in list(tensors)}))(model)


def _module_name(name: str) -> str:
    if name.startswith("visual."):
        return f"model.{name}"
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


def _tied_embeddings(model: Path) -> None:
    """Qwen/Qwen2.5-VL-3B-Instruct's ``tie_word_embeddings``: no ``lm_head`` in the file, transformers
    ties it to the embeddings when it loads."""
    _weights(lambda tensors: tensors.pop("lm_head.weight"))(model)
    _config(lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=True)))(model)


QWEN_CASES = {
    "unknown activation": (_config(lambda c: c["vision_config"].update(hidden_act="gelu_fancy")),
                           ["config.json", "vision_config.hidden_act", "'gelu_fancy'"]),
    "widths unlike the weights": (_config(lambda c: c["text_config"].update(intermediate_size=200)),
                                  [WEIGHTS, "(200, 128) per the config", "text_config.intermediate_size=200"]),
    "truncated safetensors file": (_truncate, [WEIGHTS, "truncated"]),
}


@pytest.mark.parametrize("name", sorted(QWEN_CASES))
def test_a_broken_qwen_checkpoint_is_refused_by_its_check(name, qwen_dir, tmp_path):
    edit, words = QWEN_CASES[name]
    model = Path(shutil.copytree(qwen_dir, tmp_path / "qwen"))
    edit(model)
    with pytest.raises(UserError) as err:
        _check_qwen(model)
    assert all(word in str(err.value) for word in words), str(err.value)


@pytest.mark.parametrize("edit", [None, _module_names, _tied_embeddings])
def test_qwen_checkpoints_that_load_pass(edit, qwen_dir, tmp_path):
    """Key renamings and tied weights are transformers' own: the check refuses nothing that loads."""
    model = qwen_dir
    if edit is not None:
        model = Path(shutil.copytree(qwen_dir, tmp_path / "qwen"))
        edit(model)
    _check_qwen(model)
