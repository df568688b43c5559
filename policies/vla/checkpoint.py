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
from dataclasses import dataclass
from pathlib import Path

import torch

from envs.common import UserError, unknown_name_error
from policies.vla.action_tokenizer import ActionStats

CONFIG_FILE = "config.json"
STATS_FILE = "dataset_statistics.json"  # OpenVLA's: {dataset: {"action": {"q01", "q99", "mask", ...}}}
PREPROCESSOR_FILE = "preprocessor_config.json"
# upstream's NormalizationType values -> the (low, high) fields that map to -1 and +1
NORMALIZATIONS = {"bounds_q99": ("q01", "q99"), "bounds": ("min", "max")}
NORMALIZATION_NAMES = {"bounds_q99": "q01 / q99", "bounds": "min / max"}
# OFT's third NormalizationType, which its own _unnormalize_actions / normalize_proprio reject
REFUSED_NORMALIZATIONS = {"normal": "OpenVLA-OFT defines NormalizationType.NORMAL (mean / std) but its "
                                    "_unnormalize_actions and normalize_proprio reject it (\"Unsupported "
                                    "action/proprio normalization type detected!\"), so no checkpoint acts with it"}


def read_json(path: Path) -> dict:
    """A JSON file of a checkpoint; unreadable JSON is a UserError naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}). Copy the file again from the checkpoint it "
                        "belongs to.") from err


def check_model_files(model_dir: str, needs_processor: bool) -> None:
    """A UserError naming every file a checkpoint directory lacks: the weights (every shard its
    index names), a tokenizer and, for OpenVLA-style models, ``preprocessor_config.json``."""
    root = Path(model_dir)
    missing = []
    index = root / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        missing += [s for s in shards if not (root / s).exists()]
    elif not any((root / f).exists() for f in ("model.safetensors", "pytorch_model.bin")):
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
