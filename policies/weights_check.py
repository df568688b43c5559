"""A checkpoint's weights against the network its config builds, before anything is loaded: names and
shapes from the safetensors headers (no tensor read), the network built on the meta device (no memory).

Every family calls these from its ``check_config`` (in the driver, before Ray starts), so a checkpoint
whose weights cannot fill the network is refused in seconds with one paragraph, not in a worker after
minutes. Shapes are tuples of ints, ``()`` for a scalar; dtypes are safetensors' strings (``"F32"``,
``"BF16"``, ...).

The safetensors format: 8 bytes (little-endian u64) giving the header's length ``N``, ``N`` bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, whose offsets count from the end of the header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from envs.common import UserError

EXAMPLES = 5  # names shown of each kind of difference
PREFIX_BYTES = 8  # the u64 that gives the header's length
REDOWNLOAD = ("Download it again (`huggingface-cli download <repo> --local-dir <dir>` fetches what is missing and "
              "checks each file's size), or copy it again from where the checkpoint was saved")


def safetensors_header(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, safetensors dtype)}`` over ``files``, read from their headers alone (no
    tensor data is read). A header that does not parse, or a file shorter than its header says its data
    needs (a truncated download), is a UserError naming the file."""
    found = {}
    for path in map(Path, files):
        header, needed = _read_header(path)
        size = path.stat().st_size
        if size < needed:
            raise UserError(f"{path} is {size:,} bytes, but its header says its tensors need {needed:,}: the file "
                            f"is truncated (an interrupted download or copy). {REDOWNLOAD}.")
        found.update({name: (tuple(entry["shape"]), entry["dtype"]) for name, entry in header.items()})
    return found


def _read_header(path: Path) -> tuple[dict[str, dict], int]:
    """``path``'s tensor entries (``__metadata__`` left out) and the bytes the file must have: the prefix,
    the header, and the data up to its largest end offset."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(PREFIX_BYTES))
            # a cut-short file or a bogus length: refuse before reading (a damaged length could be petabytes)
            if PREFIX_BYTES + length > path.stat().st_size:
                raise ValueError(f"its header is said to be {length:,} bytes, longer than the file")
            header = json.loads(f.read(length))
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        ends = [_entry_end(entry) for entry in entries.values()]
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({type(err).__name__}: {err}): it is truncated "
                        f"or damaged. {REDOWNLOAD}.") from None
    return entries, PREFIX_BYTES + length + max(ends, default=0)


def _entry_end(entry: dict) -> int:
    """One header entry's data end offset, its fields checked for type (a damaged header is refused)."""
    shape, dtype, (begin, end) = entry["shape"], entry["dtype"], entry["data_offsets"]
    if not (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end):
        raise ValueError(f"a malformed entry {entry}")
    return end


def meta_module(build: Callable[[], nn.Module]) -> nn.Module:
    """The module ``build()`` makes, on the meta device: every parameter has its shape, none has memory
    (a 7B model builds in about a second)."""
    with torch.device("meta"):
        return build()


def meta_state_shapes(build: Callable[[], nn.Module]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the state dict of the module ``build()`` makes on the meta device."""
    return {name: tuple(t.shape) for name, t in meta_module(build).state_dict().items()}


def reshaped(expected: dict[str, tuple[int, ...]],
             found: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, expected shape, found shape)`` of each name in both whose shapes differ, sorted by name."""
    return [(n, tuple(expected[n]), tuple(found[n])) for n in sorted(set(expected) & set(found))
            if tuple(expected[n]) != tuple(found[n])]


def weight_differences(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str:
    """What keeps ``found`` (a file's tensors) from filling ``expected`` (the network's), readably: each kind
    (missing, not the network's, other shapes) with its count and its first :data:`EXAMPLES`; '' if nothing."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    other = reshaped(expected, found)
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) the network has are missing from it ({_some(missing)})")
    if extra:
        parts.append(f"{len(extra)} weight(s) in it are not the network's ({_some(extra)})")
    if other:
        shown = [f"{n}: {f} in the file, {e} per the config" for n, e, f in other]
        parts.append(f"{len(other)} weight(s) have other shapes ({_some(shown, sep='; ')})")
    return "; ".join(parts)


def check_weights(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str,
                  fix: str) -> None:
    """A UserError naming ``source`` (the weights file) if ``found`` (its tensors' shapes) is not ``expected``
    (the network's): missing names, unexpected names and shape mismatches, a few of each with their counts,
    then ``fix`` (what to do, one sentence)."""
    problems = weight_differences(expected, found)
    if problems:
        raise UserError(f"{source} does not hold the network its config builds: {problems}. {fix.rstrip('.')}.")


def _some(items: list[str], sep: str = ", ") -> str:
    return sep.join(items[:EXAMPLES]) + (f"{sep}..." if len(items) > EXAMPLES else "")
