"""policies/weights_check.py: safetensors headers read without the data, a truncated or damaged file
refused, and missing / extra / reshaped weights named against a network built on the meta device."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from envs.common import UserError
from policies.weights_check import EXAMPLES, check_weights, meta_state_shapes, safetensors_header

NETWORK = {"encoder.weight": (4, 3), "encoder.bias": (4,), "head.weight": (2, 4), "scale": ()}


def _write(path: Path) -> Path:
    """A safetensors file of :data:`NETWORK`'s tensors, the head in bfloat16."""
    tensors = {name: torch.zeros(shape) for name, shape in NETWORK.items()}
    tensors["head.weight"] = tensors["head.weight"].bfloat16()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _shapes(header: dict) -> dict:
    return {name: shape for name, (shape, _) in header.items()}


def test_the_header_gives_every_tensors_shape_and_dtype(tmp_path):
    header = safetensors_header([_write(tmp_path / "model.safetensors")])
    assert _shapes(header) == NETWORK
    assert header["head.weight"][1] == "BF16" and header["encoder.weight"][1] == "F32"


def test_several_shards_are_read_as_one_checkpoint(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.zeros(3, 1)}, str(tmp_path / "two.safetensors"))
    assert _shapes(safetensors_header([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])) == {
        "a": (2,), "b": (3, 1)}


def test_a_truncated_file_is_refused_naming_it_and_the_fix(tmp_path):
    path = _write(tmp_path / "model.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # the header is whole, the data cut short: an interrupted download
    with pytest.raises(UserError) as err:
        safetensors_header([path])
    said = str(err.value)
    assert str(path) in said and "truncated" in said and f"{len(data) - 10:,} bytes" in said
    assert "Download it again" in said and "\n" not in said


@pytest.mark.parametrize("content", [
    b"\x01\x00",  # shorter than the header's length field
    struct.pack("<Q", 1 << 40) + b"{}",  # a header longer than the file
    struct.pack("<Q", 5) + b"{nope",  # a header that is not JSON
    struct.pack("<Q", 20) + b'{"x": {"shape": 3}} ',  # an entry without dtype or offsets
], ids=["too short", "header past the end", "not JSON", "malformed entry"])
def test_a_damaged_header_is_refused_naming_the_file(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        safetensors_header([path])
    assert str(path) in str(err.value) and "not a readable safetensors file" in str(err.value)


def test_matching_weights_pass():
    check_weights(NETWORK, dict(NETWORK), "model.safetensors", "Copy it again")


KINDS = {"missing": "the network has are missing from it", "extra": "in it are not the network's",
         "reshaped": "have other shapes"}  # how the message says each kind


@pytest.mark.parametrize("kind, found, named", [
    ("missing", {k: v for k, v in NETWORK.items() if k != "head.weight"}, "head.weight"),
    ("extra", {**NETWORK, "decoder.weight": (4, 4)}, "decoder.weight"),
    ("reshaped", {**NETWORK, "encoder.weight": (4, 5)}, "encoder.weight: (4, 5) in the file, (4, 3) per the config"),
])
def test_each_kind_of_difference_is_named(kind, found, named):
    with pytest.raises(UserError) as err:
        check_weights(NETWORK, found, "/ckpt/model.safetensors", "Copy config.json and the weights from one checkpoint")
    said = str(err.value)
    assert said.startswith("/ckpt/model.safetensors ") and said.endswith("from one checkpoint.")
    assert f"1 weight(s) {KINDS[kind]} (" in said and named in said, said
    assert not [other for other, words in KINDS.items() if other != kind and words in said], said


def test_many_differences_show_a_few_examples_and_the_counts():
    expected = {f"layers.{i}.weight": (8, 8) for i in range(12)}
    found = {**{f"layers.{i}.weight": (8, 4) for i in range(12)}, **{f"extra.{i}": (1,) for i in range(7)}}
    del found["layers.11.weight"]
    with pytest.raises(UserError) as err:
        check_weights(expected, found, "model.safetensors", "Fix it.")
    said = str(err.value)
    assert "1 weight(s) the network has are missing" in said and "7 weight(s) in it are not" in said
    assert "11 weight(s) have other shapes" in said and said.count("in the file") == EXAMPLES
    assert said.count("...") == 2 and said.endswith("Fix it.")


def test_the_network_is_built_on_the_meta_device():
    built = []

    def build() -> nn.Module:
        module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
        built.append(module)
        return module

    assert meta_state_shapes(build) == {"0.weight": (4, 3), "0.bias": (4,), "1.weight": (4,), "1.bias": (4,)}
    assert all(p.device.type == "meta" for p in built[0].parameters())  # no memory, nothing initialised
