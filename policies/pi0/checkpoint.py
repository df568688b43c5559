"""Reading pi0 / pi0.5 checkpoints offline from a local directory, in lerobot's public layout:

- ``config.json``: ``type`` (``pi0`` | ``pi05``), ``chunk_size``, ``max_action_dim``, ``max_state_dim``,
  ``input_features`` / ``output_features`` (cameras, the state's and the action's sizes),
  ``tokenizer_max_length``, ``num_inference_steps``, ``n_action_steps``;
- ``model.safetensors``: the network (every key under ``model.``), whose tensor shapes give the
  sizes (:func:`size_from_tensors`);
- ``policy_preprocessor.json`` / ``policy_postprocessor.json`` and the normaliser state files they
  name: the state's and the action's statistics and how each is normalised.

or in openpi's (``examples/convert_jax_model_to_pytorch.py``, RLinf's checkpoints):

- ``config.json``: ``action_horizon`` (the chunk), ``action_dim`` (the padded 32), the variants;
- ``model.safetensors``: the same names without ``model.``; pi0.5 if it holds ``time_mlp_in``;
- ``norm_stats.json`` (openpi: ``assets/<asset_id>/``, RLinf: ``<asset_id>/``; or ``policy.pi.norm_stats``):
  ``{"norm_stats": {"state": {mean, std, q01, q99}, "actions": {...}}}``, unpadded (their lengths are the
  state's and the action's sizes); pi0 normalises by mean/std, pi0.5 by quantiles, with openpi's eps
  (:class:`~policies.pi0.inputs.Normalizer`); three camera slots (``base_0_rgb``, ``left_wrist_0_rgb``,
  ``right_wrist_0_rgb``): the env's cameras fill the first, the rest are blank (as openpi's LIBERO
  policy leaves the right wrist).

Checkpoints converted from openpi keep the tied token embedding only as ``lm_head``: the reader takes
it from there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from envs.common import UserError
from policies.pi0.inputs import Normalizer
from policies.pi0.model import PiSize, VisionSize
from policies.pi0.transformer import StackSize

VLM = "paligemma_with_expert.paligemma.model.language_model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
VISION = "paligemma_with_expert.paligemma.model.vision_tower."
EMPTY_CAMERA = "observation.images.empty_camera_"
OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
OPENPI_MAX_TOKENS = {"pi0": 48, "pi05": 200}  # Pi0Config.max_token_len
QUERY_HEADS = 8  # both Gemma stacks of every published pi0 / pi0.5 (lerobot hard-codes it)
NORM_MODES = {"MEAN_STD": "mean_std", "QUANTILES": "quantiles"}
T = TypeVar("T")


@dataclass
class PiCheckpoint:
    """What a checkpoint directory holds, read and checked (the weights only when :meth:`tensors` is called:
    checking a 3B checkpoint reads its config and the shapes in its header, not its 13 GB)."""

    path: Path
    config: dict  # lerobot's config.json (an openpi checkpoint's: written in lerobot's terms by the reader)
    size: PiSize
    state: Normalizer | None
    action: Normalizer | None
    layout: str = "lerobot"  # or "openpi"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The network's weights, by our module names."""
        return our_names(load_file(str(self.path / "model.safetensors")))

    @property
    def cameras(self) -> list[str]:
        """The images the checkpoint reads from an env, in its order (its empty slots left out; openpi's:
        every slot, of which the env fills the first)."""
        return [k for k in self._visual() if not k.startswith(EMPTY_CAMERA)]

    def empty_cameras(self, used: int) -> int:
        """Camera slots fed blank images (a -1 image each, masked out, after the ``used`` real ones): lerobot's
        ``empty_cameras``, or openpi's slots the env does not fill."""
        if self.layout == "openpi":
            return len(OPENPI_CAMERAS) - used
        return sum(k.startswith(EMPTY_CAMERA) for k in self._visual())

    def fits_cameras(self, used: int) -> bool:
        return 1 <= used <= len(OPENPI_CAMERAS) if self.layout == "openpi" else used == len(self.cameras)

    def _visual(self) -> list[str]:
        return [k for k, f in self.config["input_features"].items() if f["type"] == "VISUAL"]

    @property
    def action_dim(self) -> int:
        return int(self.config["output_features"]["action"]["shape"][0])

    @property
    def state_dim(self) -> int:
        return int(self.config["input_features"]["observation.state"]["shape"][0])


def read_checkpoint(path: str | Path, vision_head_dim: int = 72, norm_stats: str | Path | None = None
                    ) -> PiCheckpoint:
    """Read ``path`` (see the module doc). ``vision_head_dim``: SigLIP's head size, which the tensors
    do not show (72 in so400m; the tiny test checkpoints' is 16). ``norm_stats``: an openpi checkpoint's
    statistics file, where its directory holds none or several. Raises :class:`UserError` naming the
    missing or wrong file."""
    path = Path(path)
    config = _json(path / "config.json")
    openpi = "action_horizon" in config and "type" not in config
    if not openpi and config.get("type") not in ("pi0", "pi05"):
        raise UserError(f"{path}/config.json says type={config.get('type')!r}: not a pi0 or pi0.5 checkpoint "
                        "(lerobot's config.json has type pi0 or pi05; openpi's, action_horizon). Point "
                        "policy.vla.model_path at one.")
    weights = path / "model.safetensors"
    if not weights.exists():
        raise UserError(f"{path} has no model.safetensors: a pi0 checkpoint directory holds config.json, "
                        "model.safetensors and its statistics (lerobot: the policy_pre/postprocessor files; openpi: "
                        "assets/<asset_id>/norm_stats.json). Download all of them.")
    with safe_open(str(weights), framework="pt") as f:
        shapes = our_names({name: torch.Size(f.get_slice(name).get_shape()) for name in f.keys()})
    if openpi:
        config, (state, action) = _openpi(path, config, shapes, norm_stats)
    else:
        if config.get("use_relative_actions"):
            raise UserError(f"{path}/config.json sets use_relative_actions (lerobot adds each step's state to the "
                            "actions), which policy=pi0 does not build. openpi's form (the chunk-start state added to "
                            "the leading dims) is policy.pi.delta_actions; evaluate this checkpoint with lerobot.")
        state, action = _normalizers(path, config["type"])
    size = size_from_shapes(shapes, config, vision_head_dim)
    return PiCheckpoint(path, config, size, state, action, "openpi" if openpi else "lerobot")


def _openpi(path: Path, config: dict, shapes: dict[str, torch.Size], norm_stats: str | Path | None
            ) -> tuple[dict, tuple[Normalizer, Normalizer]]:
    """An openpi checkpoint's config in lerobot's terms, and its statistics (see the module doc)."""
    kind = "pi05" if "time_mlp_in.weight" in shapes else "pi0"
    stats_file = Path(norm_stats) if norm_stats else _norm_stats_file(path)
    if not stats_file.exists():
        raise UserError(f"{stats_file} is missing (policy.pi.norm_stats): point it at the checkpoint's "
                        "norm_stats.json.")
    stats = json.loads(stats_file.read_text())["norm_stats"]
    mode = "mean_std" if kind == "pi0" else "quantiles"  # openpi: use_quantile_norm = model_type != PI0
    try:
        state, action = (Normalizer(mode, {k: torch.tensor(v) for k, v in stats[key].items() if v is not None},
                                    eps=1e-6, convention="openpi") for key in ("state", "actions"))
    except KeyError as missing:
        raise UserError(f"{stats_file} has no {missing} statistics: openpi's norm_stats.json holds state and "
                        "actions.") from None
    needed = ("mean", "std") if mode == "mean_std" else ("q01", "q99")
    if any(k not in n.stats for n in (state, action) for k in needed):
        raise UserError(f"{stats_file} lacks {' / '.join(needed)}, which {kind} normalises with. Recompute the "
                        "statistics with openpi's compute_norm_stats.")
    features = {name: {"type": "VISUAL", "shape": [3, 224, 224]} for name in OPENPI_CAMERAS}
    features["observation.state"] = {"type": "STATE", "shape": [len(state.stats[needed[0]])]}
    lerobot = {"type": kind, "chunk_size": int(config["action_horizon"]), "input_features": features,
               "output_features": {"action": {"type": "ACTION", "shape": [len(action.stats[needed[0]])]}},
               "tokenizer_max_length": OPENPI_MAX_TOKENS[kind], "n_action_steps": None, "openpi": config}
    return lerobot, (state, action)


def _norm_stats_file(path: Path) -> Path:
    """The one ``norm_stats.json`` under an openpi checkpoint directory (openpi's ``assets/<asset_id>/``,
    RLinf's ``<asset_id>/``)."""
    found = sorted(path.rglob("norm_stats.json"))
    if len(found) != 1:
        what = "none" if not found else f"{len(found)} ({', '.join(str(f.relative_to(path)) for f in found)})"
        raise UserError(f"{path} is an openpi checkpoint, whose statistics are in a norm_stats.json beside it "
                        f"(openpi: assets/<asset_id>/), and it holds {what}. Copy the training run's assets "
                        "there (openpi's converter does not), or set policy.pi.norm_stats to the file.")
    return found[0]


def our_names(tensors: dict[str, T]) -> dict[str, T]:
    """lerobot's (``model.`` prefix) or openpi's names -> ours: the vision tower's ``vision_model.``
    level dropped (transformers 5.6 flattened SigLIP), the token embedding from ``lm_head`` where a
    converted checkpoint tied it away, and the unused ``lm_head`` s left out."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        if not name.endswith("lm_head.weight"):
            out[name] = tensor
    embed = VLM + "embed_tokens.weight"
    if embed not in out:
        tied = next((t for n, t in tensors.items() if n.removeprefix("model.") == "paligemma_with_expert.paligemma."
                     "lm_head.weight"), None)
        if tied is not None:
            out[embed] = tied
    return out


def _stack(shapes: dict[str, torch.Size], prefix: str) -> StackSize:
    depth = len({m.group(1) for n in shapes if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", n))})
    layer = prefix + "layers.0."
    q, k = shapes[layer + "self_attn.q_proj.weight"], shapes[layer + "self_attn.k_proj.weight"]
    head_dim = q[0] // QUERY_HEADS
    return StackSize(width=q[1], depth=depth, mlp_dim=shapes[layer + "mlp.gate_proj.weight"][0],
                     num_heads=QUERY_HEADS, num_kv_heads=k[0] // head_dim, head_dim=head_dim)


def size_from_shapes(shapes: dict[str, torch.Size], config: dict, vision_head_dim: int) -> PiSize:
    """The network's sizes as the checkpoint's tensor shapes (our names) show them."""
    try:
        patch = shapes[VISION + "embeddings.patch_embedding.weight"]
        if patch[0] % vision_head_dim:
            raise UserError(f"the checkpoint's SigLIP is {patch[0]} wide, which heads of "
                            f"policy.pi.vision_head_dim={vision_head_dim} do not divide. Set the head size it was "
                            "built with (so400m, the public checkpoints': 72).")
        positions = shapes[VISION + "embeddings.position_embedding.weight"][0]
        vision_depth = len({m.group(1) for n in shapes
                            if (m := re.match(re.escape(VISION) + r"encoder\.layers\.(\d+)\.", n))})
        vision = VisionSize(hidden=patch[0], depth=vision_depth, heads=patch[0] // vision_head_dim,
                            mlp_dim=shapes[VISION + "encoder.layers.0.mlp.fc1.weight"][0],
                            patch=patch[-1], image_size=round(positions**0.5) * patch[-1])
        return PiSize(pi05=config["type"] == "pi05", vlm=_stack(shapes, VLM), expert=_stack(shapes, EXPERT),
                      vision=vision, vocab_size=shapes[VLM + "embed_tokens.weight"][0],
                      max_action_dim=shapes["action_in_proj.weight"][1],
                      max_state_dim=int(config.get("max_state_dim", 32)), chunk_size=int(config["chunk_size"]))
    except KeyError as missing:
        raise UserError(f"model.safetensors has no tensor {missing}: not a pi0 / pi0.5 network in lerobot's or "
                        "openpi's layout (or a truncated download).") from None


def _normalizers(path: Path, kind: str) -> tuple[Normalizer | None, Normalizer | None]:
    """The state's statistics (pre-processor) and the action's (post-processor), in the files the
    processors' JSON names."""
    state = _normalizer(path, "policy_preprocessor.json", "normalizer_processor", "observation.state", "STATE")
    action = _normalizer(path, "policy_postprocessor.json", "unnormalizer_processor", "action", "ACTION")
    return state, action


def _normalizer(path: Path, pipeline: str, step_name: str, feature: str, kind: str) -> Normalizer | None:
    spec = _json(path / pipeline)
    step = next((s for s in spec.get("steps", []) if s.get("registry_name") == step_name), None)
    if step is None:
        raise UserError(f"{path / pipeline} has no {step_name} step: the checkpoint's {feature} statistics are not "
                        "in it. Use the processor files saved with the checkpoint.")
    mode = step["config"]["norm_map"].get(kind, "IDENTITY")
    if mode == "IDENTITY":
        return None
    if mode not in NORM_MODES:
        raise UserError(f"{path / pipeline}: {feature} is normalised by {mode}; pi0 checkpoints use one of "
                        f"{sorted(NORM_MODES)}.")
    state_file = path / step["state_file"]
    if not state_file.exists():
        raise UserError(f"{state_file} is missing: {pipeline} names it for the {feature} statistics. Download it "
                        "with the checkpoint.")
    stats = {k.removeprefix(feature + "."): v for k, v in load_file(str(state_file)).items()
             if k.startswith(feature + ".")}
    return Normalizer(NORM_MODES[mode], stats, float(step["config"].get("eps", 1e-8)))


def _json(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path} is missing: a pi0 / pi0.5 checkpoint directory (lerobot's layout) holds "
                        "config.json, model.safetensors, policy_preprocessor.json and policy_postprocessor.json "
                        "with their normaliser files.")
    return json.loads(path.read_text())
