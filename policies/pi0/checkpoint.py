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

What the actions depend on and a checkpoint records is used by default (:meth:`PiCheckpoint.recorded`):
``n_action_steps`` (actions executed per chunk), ``num_inference_steps`` (Euler steps), ``image_resolution``,
``tokenizer_max_length``; ``min_period`` / ``max_period`` and ``time_sampling_*`` shape the network and its
loss. A tokenizer saved in the directory is the one used. Tiny checkpoints built with other sizes than the
public ones (the reference fixtures) say their head counts in ``tiny_overrides.json``.

:meth:`PiCheckpoint.check_weights` builds the network on the meta device from these sizes and checks every
weight's name and shape against the safetensors header, so a checkpoint lerobot would refuse is refused
before any worker starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

from envs.common import UserError
from policies.pi0.inputs import Normalizer
from policies.pi0.model import PiSize, PiZero, VisionSize
from policies.pi0.transformer import StackSize
from policies.weights_check import check_weights, meta_state_shapes, safetensors_header

VLM = "paligemma_with_expert.paligemma.model.language_model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
VISION = "paligemma_with_expert.paligemma.model.vision_tower."
EMPTY_CAMERA = "observation.images.empty_camera_"
OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
OPENPI_MAX_TOKENS = {"pi0": 48, "pi05": 200}  # Pi0Config.max_token_len
QUERY_HEADS = 8  # both Gemma stacks of every published pi0 / pi0.5 (lerobot hard-codes it)
SIGLIP_HEAD_DIM = 72  # so400m's (1152 wide, 16 heads): every published checkpoint's
NORM_MODES = {"MEAN_STD": "mean_std", "QUANTILES": "quantiles"}
DTYPES = ("float32", "bfloat16")  # lerobot's PI0Config.dtype
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
# our setting <- the config.json field that records it, and lerobot's default where a config lacks it
RECORDED = {"chunk_size": ("n_action_steps", 50), "flow.eval_steps": ("num_inference_steps", 10),
            "pi.image_size": ("image_resolution", [224, 224]), "pi.max_tokens": ("tokenizer_max_length", None),
            "vla.dtype": ("dtype", "float32")}
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
    shapes: dict[str, torch.Size]  # model.safetensors' tensors by our names, from its header
    layout: str = "lerobot"  # or "openpi"

    def recorded(self) -> dict[str, tuple[str, int | str]]:
        """``{our setting: (the config.json field, its value)}`` for what the actions depend on and the checkpoint
        records (:data:`RECORDED`; an openpi checkpoint records no ``n_action_steps``: its client replans)."""
        found = {}
        for key, (field, default) in RECORDED.items():
            value = self.config.get(field, default)
            if key == "pi.max_tokens" and value is None:
                value = OPENPI_MAX_TOKENS[self.config["type"]]
            if isinstance(value, list):  # image_resolution: [size, size]
                value = value[0]
            if value is not None:
                found[key] = (field, value)
        return found

    def tokenizer_dir(self) -> Path | None:
        """The checkpoint directory where it holds a tokenizer (lerobot saves none; a user or a fixture may)."""
        return self.path if any((self.path / f).exists() for f in TOKENIZER_FILES) else None

    def tokenizer_name(self) -> str | None:
        """The tokenizer the checkpoint's pre-processor names (lerobot's ``tokenizer_processor`` step), or
        PaliGemma's for openpi's layout."""
        if self.layout == "openpi":
            return PALIGEMMA_TOKENIZER
        spec = _json(self.path / "policy_preprocessor.json")
        step = next((s for s in spec.get("steps", []) if s.get("registry_name") == "tokenizer_processor"), {})
        return step.get("config", {}).get("tokenizer_name")

    def check_weights(self) -> None:
        """The network these sizes build, on the meta device (no memory, nothing read), against every tensor
        name and shape in ``model.safetensors``'s header: missing, extra or reshaped weights are refused."""
        expected = meta_state_shapes(lambda: PiZero(self.size))
        check_weights(expected, {n: tuple(s) for n, s in self.shapes.items()}, str(self.path / "model.safetensors"),
                      f"a {self.config['type']} network of these sizes has them; the file is another network's or "
                      "was written wrong: use the checkpoint's own model.safetensors, saved by lerobot "
                      "(save_pretrained) or openpi's converter")

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


def read_checkpoint(path: str | Path, vision_head_dim: int | None = None, norm_stats: str | Path | None = None
                    ) -> PiCheckpoint:
    """Read ``path`` (see the module doc). ``vision_head_dim``: SigLIP's head size, which the tensors
    do not show (None: ``tiny_overrides.json``'s, else so400m's 72). ``norm_stats``: an openpi checkpoint's
    statistics file, where its directory holds none or several. Raises :class:`UserError` naming the
    missing or wrong file or field."""
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
    shapes = {n: torch.Size(s) for n, (s, _) in our_names(safetensors_header([weights])).items()}
    if openpi:
        config, (state, action) = _openpi(path, config, shapes, norm_stats)
    else:
        if config.get("use_relative_actions"):
            raise UserError(f"{path}/config.json sets use_relative_actions (lerobot adds each step's state to the "
                            "actions), which policy=pi0 does not build. openpi's form (the chunk-start state added to "
                            "the leading dims) is policy.pi.delta_actions; evaluate this checkpoint with lerobot.")
        state, action = _normalizers(path, config["type"])
    _check_fields(path / "config.json", config)
    size = size_from_shapes(shapes, config, *_head_sizes(path, vision_head_dim), source=str(weights))
    return PiCheckpoint(path, config, size, state, action, shapes, "openpi" if openpi else "lerobot")


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
               "tokenizer_max_length": OPENPI_MAX_TOKENS[kind], "n_action_steps": None, "num_inference_steps": 10,
               "image_resolution": [224, 224], "openpi": config}
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


def _check_fields(source: Path, config: dict) -> None:
    """What lerobot's PI0Config / PI05Config would refuse when it builds the model: an unknown dtype, a
    non-square or unreadable image_resolution, step counts below one."""
    dtype = config.get("dtype", "float32")
    if dtype not in DTYPES:
        raise UserError(f"{source} says dtype={dtype!r}, which lerobot's pi0 / pi0.5 do not run (they take one of "
                        f"{list(DTYPES)}): the file was edited or is another model's. Set it to the dtype the "
                        "checkpoint was saved for (the public ones: bfloat16), or restore the original config.json.")
    resolution = config.get("image_resolution", [224, 224])
    if not (isinstance(resolution, list) and len(resolution) == 2 and resolution[0] == resolution[1]
            and isinstance(resolution[0], int) and resolution[0] > 0):
        raise UserError(f"{source} says image_resolution={resolution!r}: PaliGemma takes square images, a list "
                        "[size, size] (the public checkpoints': [224, 224]). Restore the original config.json.")
    for field in ("num_inference_steps", "n_action_steps", "chunk_size", "tokenizer_max_length"):
        value = config.get(field)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"{source} says {field}={value!r}: it must be a positive integer. Restore the original "
                            "config.json.")


def _head_sizes(path: Path, vision_head_dim: int | None) -> tuple[int, int]:
    """(SigLIP's head size, the Gemma stacks' query heads): the checkpoint's ``tiny_overrides.json`` where it
    has one (tiny checkpoints built with other sizes), else the public checkpoints' (72, 8);
    ``policy.pi.vision_head_dim`` wins."""
    overrides = path / "tiny_overrides.json"
    if not overrides.exists():
        return vision_head_dim or SIGLIP_HEAD_DIM, QUERY_HEADS
    sizes = json.loads(overrides.read_text())
    try:
        vision = sizes["vision_config"]
        heads = int(vision["num_attention_heads"])
        if int(vision["hidden_size"]) % heads:
            raise UserError(f"{overrides}: SigLIP is {vision['hidden_size']} wide, which {heads} heads do not divide "
                            "(num_attention_heads). Set the head count the checkpoint was built with.")
        return vision_head_dim or int(vision["hidden_size"]) // heads, int(sizes["paligemma_variant"]["num_heads"])
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{overrides} lacks or garbles {err}: it says the sizes a tiny checkpoint was built with "
                        "(vision_config.hidden_size / num_attention_heads, paligemma_variant.num_heads). Restore it "
                        "as it was written with the checkpoint.") from None


def _stack(shapes: dict[str, torch.Size], prefix: str, heads: int, source: str) -> StackSize:
    depth = len({m.group(1) for n in shapes if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", n))})
    layer = prefix + "layers.0."
    q, k = shapes[layer + "self_attn.q_proj.weight"], shapes[layer + "self_attn.k_proj.weight"]
    if q[0] % heads or k[0] % (q[0] // heads):
        raise UserError(f"{source}: {prefix}'s attention projects to {q[0]} query and {k[0]} key numbers, which "
                        f"{heads} heads do not divide into whole heads. The weights are another network's, or the "
                        "head count (tiny_overrides.json's num_heads) is wrong.")
    head_dim = q[0] // heads
    return StackSize(width=q[1], depth=depth, mlp_dim=shapes[layer + "mlp.gate_proj.weight"][0],
                     num_heads=heads, num_kv_heads=k[0] // head_dim, head_dim=head_dim)


def size_from_shapes(shapes: dict[str, torch.Size], config: dict, vision_head_dim: int = SIGLIP_HEAD_DIM,
                     query_heads: int = QUERY_HEADS, source: str = "model.safetensors") -> PiSize:
    """The network's sizes as the checkpoint's tensor shapes (our names) and its config.json show them."""
    try:
        patch = shapes[VISION + "embeddings.patch_embedding.weight"]
        if patch[0] % vision_head_dim:
            raise UserError(f"the checkpoint's SigLIP is {patch[0]} wide, which heads of "
                            f"policy.pi.vision_head_dim={vision_head_dim} do not divide. Set the head size it was "
                            "built with (so400m, the public checkpoints': 72).")
        positions = shapes[VISION + "embeddings.position_embedding.weight"][0]
        resolution = int(config.get("image_resolution", [224, 224])[0])
        if (resolution // patch[-1]) ** 2 != positions:
            raise UserError(f"config.json's image_resolution {resolution} with patches of {patch[-1]} px makes "
                            f"{(resolution // patch[-1]) ** 2} patches, but {source} has {positions} positions: the "
                            "config is another checkpoint's. Restore the image_resolution it was trained with.")
        vision_depth = len({m.group(1) for n in shapes
                            if (m := re.match(re.escape(VISION) + r"encoder\.layers\.(\d+)\.", n))})
        vision = VisionSize(hidden=patch[0], depth=vision_depth, heads=patch[0] // vision_head_dim,
                            mlp_dim=shapes[VISION + "encoder.layers.0.mlp.fc1.weight"][0],
                            patch=patch[-1], image_size=resolution)
        return PiSize(pi05=config["type"] == "pi05", vlm=_stack(shapes, VLM, query_heads, source),
                      expert=_stack(shapes, EXPERT, query_heads, source), vision=vision,
                      vocab_size=shapes[VLM + "embed_tokens.weight"][0],
                      max_action_dim=shapes["action_in_proj.weight"][1],
                      max_state_dim=int(config.get("max_state_dim", 32)), chunk_size=int(config["chunk_size"]),
                      min_period=float(config.get("min_period", 4e-3)), max_period=float(config.get("max_period", 4.0)))
    except KeyError as missing:
        raise UserError(f"{source} has no tensor {missing}: not a pi0 / pi0.5 network in lerobot's or "
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
