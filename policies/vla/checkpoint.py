"""What an OpenVLA-family checkpoint directory says, read and checked before any weights load.

A public checkpoint (openvla/openvla-7b and its fine-tunes, OpenVLA-OFT's) is a directory of
``config.json``, weights, a tokenizer, ``preprocessor_config.json``, ``dataset_statistics.json``
and, for OFT, component files (``action_head--*_checkpoint.pt``, ...). Every option those files
can hold is either understood here or refused here with a message naming the file, the field,
the value and the fix (docs/vla_checkpoints.md lists them all). The policies call these same
functions when they build, and ``check_config`` calls them before any worker starts, so what
fails in a worker is never a checkpoint problem found late.

Statistics: ``{dataset: {"action": {...}, "proprio": {...}}}``, each block with ``q01`` / ``q99``
/ ``min`` / ``max`` (lists of ``D`` floats) and an optional boolean ``mask`` of the dimensions
that are normalised. Which pair normalises is the checkpoint's **normalisation**: upstream
records it nowhere in the checkpoint (OFT's ``constants.py`` picks it per robot platform,
OpenVLA always uses q01 / q99), so ``policy.vla.normalization`` names it, upstream's default first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from envs.common import UserError, unknown_name_error
from policies.vla.action_tokenizer import ActionStats
from policies.weights_check import check_weights, meta_module, reshaped, safetensors_header

CONFIG_FILE = "config.json"
STATS_FILE = "dataset_statistics.json"  # OpenVLA's: {dataset: {"action": {"q01", "q99", "mask", ...}}}
PREPROCESSOR_FILE = "preprocessor_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint: {"weight_map": {tensor: shard file}}
DTYPE_FIELDS = ("torch_dtype", "dtype")  # config.json's weights dtype: transformers reads it as torch.<name>
ACTIVATION_FIELDS = ("hidden_act",)  # transformers builds these as ACT2FN[<name>]
# upstream's NormalizationType values -> the (low, high) fields that map to -1 and +1
NORMALIZATIONS = {"bounds_q99": ("q01", "q99"), "bounds": ("min", "max")}
NORMALIZATION_NAMES = {"bounds_q99": "q01 / q99", "bounds": "min / max"}
# OFT's third NormalizationType, which its own _unnormalize_actions / normalize_proprio reject
REFUSED_NORMALIZATIONS = {"normal": "OpenVLA-OFT defines NormalizationType.NORMAL (mean / std) but its "
                                    "_unnormalize_actions and normalize_proprio reject it (\"Unsupported "
                                    "action/proprio normalization type detected!\"), so no checkpoint acts with it"}


@contextmanager
def quiet_transformers():
    """No progress bars or advice from transformers while a checkpoint loads (every worker loads one);
    real problems are ours to report (:func:`policies.vla.policy.load_strictly`)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def read_json(path: Path) -> dict:
    """A JSON file of a checkpoint; unreadable JSON is a UserError naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}). Copy the file again from the checkpoint it "
                        "belongs to.") from err


def recorded_image_size(model_dir: str | None) -> int | None:
    """The first vision backbone's input size an OpenVLA checkpoint's config.json records (``image_sizes``), or
    None (no checkpoint, or one whose config does not read: check_config refuses it with the reason)."""
    try:
        sizes = read_json(Path(model_dir) / CONFIG_FILE).get("image_sizes") if model_dir else None
        return int(sizes[0]) if sizes else None
    except (UserError, OSError, ValueError, TypeError, IndexError, AttributeError):
        return None


def check_model_files(model_dir: str, needs_processor: bool) -> None:
    """A UserError naming every file a checkpoint directory lacks: the weights (every shard its
    index names), a tokenizer and, for OpenVLA-style models, ``preprocessor_config.json``."""
    root = Path(model_dir)
    missing = []
    index = root / INDEX_FILE
    if index.exists():
        missing += [str(s.relative_to(root)) for s in weight_files(model_dir) if not s.exists()]
    elif not any((root / f).exists() for f in (WEIGHTS_FILE, "pytorch_model.bin")):
        missing.append("model.safetensors (or model.safetensors.index.json and its shards)")
    if not any((root / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json or tokenizer.model")
    if needs_processor and not (root / PREPROCESSOR_FILE).exists():
        missing.append(f"{PREPROCESSOR_FILE} (the image processor's resize and normalisation)")
    if missing:
        raise UserError(f"policy.vla.model_path={model_dir} is missing {', '.join(missing)}. Copy the whole checkpoint "
                        "directory (`huggingface-cli download <repo> --local-dir <dir>` on a machine with internet "
                        "fetches every file); nothing is downloaded at run time.")


def check_normalization(name: str) -> None:
    """``policy.vla.normalization`` must be one of :data:`NORMALIZATIONS`."""
    if name in REFUSED_NORMALIZATIONS:
        raise UserError(f"policy.vla.normalization={name}: {REFUSED_NORMALIZATIONS[name]}. Use bounds_q99 "
                        "(q01 / q99: LIBERO, Bridge) or bounds (min / max: ALOHA).")
    if name not in NORMALIZATIONS:
        raise unknown_name_error("normalisation (policy.vla.normalization)", name, list(NORMALIZATIONS))


@dataclass(frozen=True)
class Statistics:
    """One dataset's statistics in a checkpoint: where they came from, and the raw blocks."""

    key: str  # the dataset (``policy.vla.unnorm_key``)
    source: str  # "dataset_statistics.json" or "config.json norm_stats"
    blocks: dict  # {"action": {...}, "proprio": {...}, ...}

    def bounds(self, block: str, normalization: str, model_dir: str) -> ActionStats | None:
        """The ``block``'s (low, high, mask) under ``normalization``; None if the dataset has no such block."""
        stats = self.blocks.get(block)
        if stats is None:
            return None
        low_key, high_key = NORMALIZATIONS[normalization]
        where = f"{model_dir}/{self.source}[{self.key}][{block}]"
        missing = [k for k in (low_key, high_key) if k not in stats]
        if missing:
            have = sorted(k for k in stats if isinstance(stats[k], list))
            raise UserError(f"{where} has no {missing} (it has {have}), which policy.vla.normalization={normalization} "
                            f"un-normalises with. Set policy.vla.normalization to the checkpoint's own scheme "
                            f"({', '.join(f'{n}: {NORMALIZATION_NAMES[n]}' for n in NORMALIZATIONS)}).")
        low, high = stats[low_key], stats[high_key]
        mask = stats.get("mask", [True] * len(low))
        if not len(low) == len(high) == len(mask):
            raise UserError(f"{where}: {low_key}, {high_key} and mask have different lengths "
                            f"({len(low)}, {len(high)}, {len(mask)}). The file is damaged: copy it again.")
        return ActionStats(torch.tensor(low, dtype=torch.float64), torch.tensor(high, dtype=torch.float64),
                           torch.tensor(mask, dtype=torch.bool))


def dataset_statistics(model_dir: str, norm_stats: dict | None, unnorm_key: str | None) -> Statistics | None:
    """The statistics of the dataset ``policy.vla.unnorm_key`` names (optional when there is one) in
    a checkpoint's ``dataset_statistics.json``, else in its config.json ``norm_stats`` (the file wins,
    as in OpenVLA); None when it has neither. A key it lacks is a UserError."""
    path = Path(model_dir) / STATS_FILE
    stats = read_json(path) if path.exists() else norm_stats
    if not stats:
        return None
    if unnorm_key is None and len(stats) == 1:
        unnorm_key = next(iter(stats))
    if unnorm_key not in stats:
        raise UserError(f"policy.vla.unnorm_key={unnorm_key}: {model_dir} has action statistics for {sorted(stats)}. "
                        f"Set policy.vla.unnorm_key to the dataset whose actions the env takes (e.g. "
                        f"policy.vla.unnorm_key={sorted(stats)[-1]}).")
    source = STATS_FILE if path.exists() else f"{CONFIG_FILE} norm_stats"
    return Statistics(unnorm_key, source, stats[unnorm_key])


def checkpoint_action_stats(model_dir: str, norm_stats: dict | None, unnorm_key: str | None, action_dim: int,
                            normalization: str = "bounds_q99") -> ActionStats:
    """The action statistics a checkpoint was trained with (:func:`dataset_statistics`), under
    ``normalization``; none there: actions in [-1, 1]. Another action size is a UserError."""
    return action_bounds(dataset_statistics(model_dir, norm_stats, unnorm_key), model_dir, action_dim, normalization)


def action_bounds(found: Statistics | None, model_dir: str, action_dim: int | None,
                  normalization: str) -> ActionStats | None:
    """``found``'s action block under ``normalization`` (identity without one); its size must be
    ``action_dim`` (None: not known yet, only the block's fields are checked)."""
    if found is None or "action" not in found.blocks:
        return None if action_dim is None else ActionStats.identity(action_dim)
    stats = found.bounds("action", normalization, model_dir)
    if action_dim is not None and len(stats.low) != action_dim:
        raise UserError(f"policy.vla.unnorm_key={found.key} of {model_dir} has {len(stats.low)}-dim actions; the "
                        f"env's are {action_dim}-dim. This checkpoint was trained for another robot or controller: "
                        "pick the statistics of a dataset with this env's action space (policy.vla.unnorm_key), an env "
                        "whose actions match (e.g. env.control_mode), or a checkpoint trained for this env.")
    return stats


def weight_files(model_dir: str) -> list[Path]:
    """The safetensors files of a checkpoint: every shard its index names, else ``model.safetensors``;
    none for a ``pytorch_model.bin`` checkpoint."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index} has no weight_map (tensor name -> shard file). The file is damaged: copy it "
                            "again from the checkpoint it belongs to.")
        return [root / name for name in sorted(set(weight_map.values()))]
    return [root / WEIGHTS_FILE] if (root / WEIGHTS_FILE).exists() else []


def read_pretrained_config(config_class, model_dir: str, what: str):
    """``model_dir``'s config.json as ``config_class`` (transformers' parsing, the one ``from_pretrained``
    uses), after :func:`check_config_fields`: a file that does not parse, or whose values transformers'
    config validation refuses (a ``hidden_size`` no multiple of the heads), is a UserError naming it."""
    path = Path(model_dir) / CONFIG_FILE
    check_config_fields(read_json(path), path)  # also: a file that is not JSON, said in our words
    try:
        with quiet_transformers():  # its warnings about values it then refuses would only repeat the error
            return config_class.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as err:
        said = " ".join(str(err).split())  # transformers' validation errors span lines: one paragraph
        raise UserError(f"{path} does not read as {what} config ({said}). Copy config.json again from the "
                        "checkpoint it belongs to.") from err


def check_config_fields(raw: dict, path: Path) -> None:
    """config.json's fields (at any depth: ``text_config``, ``vision_config``) that transformers turns into
    objects: a dtype field must name a torch floating-point dtype, ``hidden_act`` one of transformers'
    activations (``ACT2FN``, which the model's constructor indexes). Either wrong is a UserError."""
    from transformers.activations import ACT2FN

    for field, key, value in _fields(raw):
        if key in DTYPE_FIELDS and value is not None and not _is_float_dtype(value):
            raise UserError(f"{path}: {field}={value!r} is not a torch floating-point dtype (transformers reads it "
                            "as torch.<name>: float32, bfloat16, float16, float64). Set it to the dtype the weights "
                            "are saved in (bfloat16 for the public OpenVLA checkpoints), or copy config.json again "
                            "from the checkpoint it belongs to.")
        if key in ACTIVATION_FIELDS and not (isinstance(value, str) and value in ACT2FN):
            err = unknown_name_error(f"activation ({field})", str(value), list(ACT2FN))
            raise UserError(f"{path}: {err} transformers builds the layer from this name (ACT2FN), so upstream's "
                            "code cannot build the model either. Set it to the checkpoint's own (silu for "
                            "Llama-2 and Qwen2.5), or copy config.json again from the checkpoint it belongs to.")


def _fields(raw: dict | list, prefix: str = "") -> Iterator[tuple[str, str, object]]:
    """``(dotted field, key, value)`` of every key of ``raw`` and of the dicts inside it, lists included
    (``timm_overrides[1].embed_dim``)."""
    items = raw.items() if isinstance(raw, dict) else ((f"[{i}]", v) for i, v in enumerate(raw))
    for key, value in items:
        field = f"{prefix}{key}" if key.startswith("[") or not prefix else f"{prefix}.{key}"
        if not key.startswith("["):
            yield field, key, value
        if isinstance(value, (dict, list)):
            yield from _fields(value, field)


def _is_float_dtype(name: object) -> bool:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def check_pretrained_weights(model_dir: str, build: Callable[[], nn.Module]) -> None:
    """The network ``build()`` makes (the class and config ``from_pretrained`` is given), built on the meta
    device, against every tensor name and shape in the checkpoint's safetensors headers, as transformers
    will load them (its key renamings for the class; tied and ignorable weights may be absent). Reads
    config.json and the headers only: seconds for a 7B checkpoint. A ``pytorch_model.bin`` checkpoint is
    left to the loader (:func:`policies.vla.policy.load_strictly`)."""
    files = weight_files(model_dir)
    if not files:
        return
    found = {name: shape for name, (shape, _) in safetensors_header(files).items()}
    model = _meta_build(build, model_dir)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    loaded = _as_loaded(model, found, expected)
    may_be_missing, may_be_extra = _ignored(model)
    expected = {n: s for n, s in expected.items() if n in loaded or not may_be_missing(n)}
    loaded = {n: s for n, s in loaded.items() if n in expected or not may_be_extra(n)}
    source = str(files[0]) if len(files) == 1 else f"the {len(files)} shards of {Path(model_dir) / INDEX_FILE}"
    fix = ("config.json and the weights come from different checkpoints, or one of them was edited or damaged: "
           f"copy both from one checkpoint{_sizes_hint(model_dir, expected, loaded)}")
    check_weights(expected, loaded, source, fix)


def _meta_build(build: Callable[[], nn.Module], model_dir: str) -> nn.Module:
    """``build()`` on the meta device; what makes the model's own constructor fail is a UserError (the
    values config.json gives have been checked already: this is the net under those checks)."""
    try:
        with quiet_transformers():
            return meta_module(build)
    except UserError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError, AssertionError, ZeroDivisionError) as err:
        raise UserError(f"{Path(model_dir) / CONFIG_FILE} does not build a network ({type(err).__name__}: {err}); "
                        "upstream's code refuses it as well. Copy config.json again from the checkpoint it belongs "
                        "to.") from None


def _as_loaded(model: nn.Module, found: dict[str, tuple[int, ...]],
               expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The file's names as transformers loads them into ``model``: its conversion mapping for the class
    (renamings, then at most one converter), the base-model prefix added or stripped, as its loader does.
    A converted tensor (e.g. experts fused into one) takes the network's shape: only its name is checked."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    loaded = {}
    for name, shape in found.items():
        renamed, converter = rename_source_key(name, renamings, converters, prefix, expected)
        if renamed not in expected and name in expected:  # transformers' own fallback: the name as it is
            renamed, converter = rename_source_key(name, [], [], prefix, expected)
        loaded[renamed] = expected.get(renamed, shape) if converter is not None else shape
    return loaded


def _ignored(model: nn.Module) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(may this weight be absent from the file, may this one be in it unused): the model's tied weights
    (filled from their source), its class's ignore patterns, and buffers older checkpoints saved, as
    transformers' loader treats them."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = _any_of(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    old = [pattern for pattern, end in OLD_BUFFERS.items() if any(b.endswith(end) for b in buffers)]
    unexpected = _any_of([*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *old])
    return (lambda n: n in tied or missing.search(n) is not None), (lambda n: unexpected.search(n) is not None)


def _any_of(patterns) -> re.Pattern:
    """One regex matching any of ``patterns`` (none: one that matches nothing)."""
    return re.compile("|".join(f"({p})" for p in patterns) or "(?!)")


# buffers transformers' loader lets a checkpoint hold when the model has them (under another name, or
# not persistent now): pattern -> the buffer name's end
OLD_BUFFERS = {r"rotary_emb\.inv_freq": "rotary_emb.inv_freq", r"(^|\.)position_ids$": "position_ids"}


def _sizes_hint(model_dir: str, expected: dict[str, tuple[int, ...]], loaded: dict[str, tuple[int, ...]]) -> str:
    """Where the network's sizes that the weights lack come from: config.json's fields that set them
    (``text_config.intermediate_size=48``), as '' when none or nothing is reshaped."""
    sizes = {e for _, want, have in reshaped(expected, loaded) for e, h in zip(want, have, strict=False) if e != h}
    if not sizes:
        return ""
    fields = [f"{field}={value}" for field, _, value in _fields(read_json(Path(model_dir) / CONFIG_FILE))
              if type(value) is int and value in sizes]
    return f" (config.json's fields of the sizes the weights lack: {', '.join(fields[:4])})" if fields else ""
