"""Build tiny pi0 / pi0.5 checkpoints with openpi's own PyTorch model and record what it computes.

Runs in the throwaway reference venv that ``make_openpi_fixtures.sh`` makes (torch 2.13.0+cpu,
transformers 4.53.2 with openpi's ``src/openpi/models_pytorch/transformers_replace/`` copied over the
installed package, as openpi's README says), never in the project's venv, and imports openpi from a
source tree you fetched yourself (``--src``: a checkout's root or its ``src/``). No openpi code is
copied into the project.

What runs is openpi's: ``openpi.models_pytorch.pi0_pytorch.PI0Pytorch`` (``embed_prefix``,
``embed_suffix``, ``sample_actions``, ``denoise_step``), ``gemma_pytorch.PaliGemmaWithExpertModel``,
``preprocessing_pytorch.preprocess_observation_pytorch`` and the patched transformers classes
(adaRMS ``GemmaRMSNorm``, the KV cache read without being updated, SigLIP). What is stubbed or
patched, and why (changing no computation on the path that runs):

- ``openpi.models.gemma`` (a flax / jax module, of which the PyTorch model reads only
  ``get_config(variant)``'s six sizes) is a stub module whose ``get_config`` returns the tiny sizes
  (:class:`Shape`) for the two variant names the config keeps (``gemma_2b`` / ``gemma_300m``);
- ``openpi.shared.image_tools`` (jax-jitted; the PyTorch preprocessing calls only its
  ``resize_with_pad_torch``, for images that are not 224 x 224) is a stub whose function raises:
  the fixture's images are already 224 x 224, as openpi's clients send them;
- the model config is a plain namespace with the fields ``PI0Pytorch`` reads (``openpi.models.pi0_config
  .Pi0Config`` imports flax / jax): ``pi05``, the variants, ``dtype="float32"``, ``action_dim``,
  ``action_horizon``, ``max_token_len`` and ``pytorch_compile_mode=None`` (no ``torch.compile`` of
  ``sample_actions``: same graph, eager);
- ``gemma_pytorch.PaliGemmaForConditionalGeneration`` and ``GemmaForCausalLM`` (the module globals
  ``PaliGemmaWithExpertModel.__init__`` calls) are wrapped to shrink, on the Hugging Face config
  openpi built, what its hard-coded PaliGemma config keeps at full size: the vocabulary (257152),
  SigLIP's hidden size / depth / heads / MLP (so400m) and the projector's output (2048). The image
  stays 224 px with 14 px patches (openpi resizes every camera to 224, and the 256 patch positions
  follow).
- the observation is a namespace with the fields ``preprocess_observation_pytorch`` reads (openpi's
  ``Observation`` is a flax struct); images ``[B, 3, 224, 224]`` float in [-1, 1] (channels first,
  which it accepts), built from uint8 frames as ``Observation.from_dict`` does (``/ 255 * 2 - 1``).

Every parameter is re-drawn from one seeded generator (:func:`randomize`): weights with fan-in n as
``randn / sqrt(n)`` (embeddings by their width), 1-D tensors (biases, RMS / layer norm weights) as
``0.1 * randn``, including the adaRMS ``dense`` layers, which openpi initialises to zero. The weights
are drawn in place, so PaliGemma's ``lm_head`` stays tied to ``embed_tokens``.

The checkpoint is written as openpi's ``examples/convert_jax_model_to_pytorch.py`` writes one:
``safetensors.torch.save_model(model, "model.safetensors")`` (which keeps the tied token embedding
only as ``paligemma_with_expert.paligemma.lm_head.weight`` and saves the expert's unused ``lm_head``),
``config.json`` with the converter's five keys, and the training assets it copies
(``assets/physical-intelligence/libero/norm_stats.json``, made-up statistics in
``openpi.shared.normalize``'s format: 8-D state, 7-D actions). ``tiny_sizes.json`` beside them (the one
file a real checkpoint lacks) records the sizes, SigLIP's head count among them (the tensors do not
show it).

Recorded (``<name>_outputs.npz``, float32 unless said): the inputs (``frames_u8``, ``images``
``[cameras, B, 3, 224, 224]``, ``image_masks`` ``[cameras, B]``, ``tokens`` / ``token_mask``
``[B, max_token_len]``, ``state_raw`` ``[B, 8]``, ``state`` ``[B, 32]`` normalised as openpi's
``transforms.Normalize`` does (pi0: mean / std, pi0.5: quantiles) and zero-padded, ``noise`` ``[B, H, 32]``),
``embed_prefix``'s output (``prefix_embs``, ``prefix_pad_masks``), each Euler step's
``denoise_step`` call (``step_t`` ``[K, B]``, ``step_x`` ``[K, B, H, 32]`` its input, ``step_v`` its
velocity) and ``sample_actions``' result (``actions`` ``[B, H, 32]``); ``float32_matmul_precision`` and
``openpi_sources_json`` (sha256 of the openpi files that ran) as 0-d strings.

Usage (from make_openpi_fixtures.sh):
``python openpi_fixtures.py {openpi_pi0_tiny,openpi_pi05_tiny,all} --src OPENPI --out assets/reference``
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import hashlib
import importlib
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
from pi0_fixtures import randomize  # this directory's: the same weight draw as the lerobot fixtures

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
ASSET_ID = "physical-intelligence/libero"

# ---------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    pi05: bool
    # Gemma (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim); openpi's joint attention
    # hard-codes 8 query heads (gemma_pytorch.py: ``1 * 8 * head_dim``)
    vlm: tuple[int, ...] = (64, 2, 128, 8, 1, 16)
    expert: tuple[int, ...] = (32, 2, 64, 8, 1, 16)
    # SigLIP (hidden, layers, heads, intermediate, patch, image): openpi resizes to 224
    siglip: tuple[int, ...] = (32, 2, 2, 64, 14, 224)
    vocab: int = 1024
    action_dim: int = 32  # the padded action / state size (Pi0Config.action_dim)
    action_horizon: int = 50
    max_token_len: int = 48  # Pi0Config: 48 (pi0), 200 (pi0.5)
    state_dim: int = 8  # LIBERO's, in the statistics
    action_out_dim: int = 7
    batch: int = 2
    token_lengths: tuple[int, ...] = (21, 37)  # valid tokens per row, BOS included
    num_steps: int = 10
    seed: int = 0


SHAPES = {
    "openpi_pi0_tiny": Shape(pi05=False),
    "openpi_pi05_tiny": Shape(pi05=True, action_horizon=10, max_token_len=200, token_lengths=(58, 131), seed=1),
}
VARIANTS = ("gemma_2b", "gemma_300m")  # what config.json names, as a real conversion's does


def sizes_json(shape: Shape) -> dict:
    keys = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
    return {
        "paligemma_variant": dict(zip(keys, shape.vlm, strict=True)),
        "action_expert_variant": dict(zip(keys, shape.expert, strict=True)),
        "vision_config": dict(zip(("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                   "patch_size", "image_size"), shape.siglip, strict=True),
                              head_dim=shape.siglip[0] // shape.siglip[2], projection_dim=shape.vlm[0]),
        "vocab_size": shape.vocab,
        "max_token_len": shape.max_token_len,
        "num_steps": shape.num_steps,
    }


# ---------------------------------------------------------------------------------------------
# Importing openpi's PyTorch model without jax


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def check_transformers_replace(src: Path) -> None:
    """The installed transformers is 4.53.2 with openpi's replacement files, byte for byte."""
    import transformers

    if transformers.__version__ != "4.53.2":
        raise SystemExit(f"transformers {transformers.__version__}: openpi's PyTorch model needs 4.53.2")
    replace = src / "openpi" / "models_pytorch" / "transformers_replace"
    installed = Path(transformers.__file__).parent
    for f in sorted(replace.rglob("*.py")):
        target = installed / f.relative_to(replace)
        if not target.is_file() or not filecmp.cmp(f, target, shallow=False):
            raise SystemExit(f"{target} is not openpi's {f}: cp -r {replace}/* {installed}/")


def import_openpi(src: Path) -> types.SimpleNamespace:
    src = src.resolve()
    if (src / "src" / "openpi").is_dir():
        src = src / "src"
    if not (src / "openpi" / "models_pytorch" / "pi0_pytorch.py").is_file():
        raise SystemExit(f"{src} is not an openpi source tree (no openpi/models_pytorch/pi0_pytorch.py)")
    check_transformers_replace(src)
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(src))
    importlib.import_module("openpi.models")  # empty __init__s
    importlib.import_module("openpi.shared")

    @dataclasses.dataclass(frozen=True)
    class Config:  # the fields of openpi.models.gemma.Config the PyTorch model reads
        width: int
        depth: int
        mlp_dim: int
        num_heads: int
        num_kv_heads: int
        head_dim: int

    current: dict[str, Shape] = {}

    def get_config(variant):
        shape = current["shape"]
        return Config(*{VARIANTS[0]: shape.vlm, VARIANTS[1]: shape.expert}[variant])

    def resize_with_pad_torch(*args, **kwargs):
        raise AssertionError("the fixture's images are 224 x 224: openpi should not resize them")

    _stub("openpi.models.gemma", Config=Config, get_config=get_config)
    _stub("openpi.shared.image_tools", resize_with_pad_torch=resize_with_pad_torch)
    gp = importlib.import_module("openpi.models_pytorch.gemma_pytorch")
    pp = importlib.import_module("openpi.models_pytorch.pi0_pytorch")
    prep = importlib.import_module("openpi.models_pytorch.preprocessing_pytorch")

    paligemma_cls, gemma_cls = gp.PaliGemmaForConditionalGeneration, gp.GemmaForCausalLM

    def paligemma(config):
        shape = current["shape"]
        hidden, layers, heads, mlp, patch, image = shape.siglip
        assert config.text_config.hidden_size == shape.vlm[0]
        config._vocab_size = shape.vocab  # noqa: SLF001 (openpi sets it so)
        config.image_token_index = shape.vocab
        config.text_config.vocab_size = shape.vocab
        vision = config.vision_config
        vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads = hidden, layers, heads
        vision.intermediate_size, vision.patch_size, vision.image_size = mlp, patch, image
        vision.projection_dim = shape.vlm[0]
        config.projection_dim = shape.vlm[0]
        config.hidden_size = shape.vlm[0]
        config.text_config.num_image_tokens = (image // patch) ** 2
        return paligemma_cls(config=config)

    def gemma(config):
        config.vocab_size = current["shape"].vocab
        return gemma_cls(config=config)

    gp.PaliGemmaForConditionalGeneration, gp.GemmaForCausalLM = paligemma, gemma
    return types.SimpleNamespace(src=src, gemma_pytorch=gp, pi0_pytorch=pp, preprocessing=prep, current=current)


# ---------------------------------------------------------------------------------------------
# Building


def model_config(shape: Shape) -> types.SimpleNamespace:
    return types.SimpleNamespace(pi05=shape.pi05, paligemma_variant=VARIANTS[0], action_expert_variant=VARIANTS[1],
                                 dtype="float32", action_dim=shape.action_dim, action_horizon=shape.action_horizon,
                                 max_token_len=shape.max_token_len, pytorch_compile_mode=None)


def norm_stats(rng: np.random.Generator, shape: Shape) -> dict:
    """Made-up statistics in openpi's norm_stats.json format (``openpi.shared.normalize.NormStats``)."""

    def vector(n):
        mean = rng.normal(0.0, 0.5, n)
        std = rng.uniform(0.1, 1.0, n)
        q01 = mean - std * rng.uniform(1.8, 2.6, n)
        q99 = mean + std * rng.uniform(1.8, 2.6, n)
        return {k: [float(x) for x in v.astype(np.float32)] for k, v in
                dict(mean=mean, std=std, q01=q01, q99=q99).items()}

    return {"norm_stats": {"state": vector(shape.state_dim), "actions": vector(shape.action_out_dim)}}


def normalize_state(state: np.ndarray, stats: dict, pi05: bool) -> np.ndarray:
    """openpi's ``transforms.Normalize`` (``use_quantiles = model_type != PI0``), float32 as it runs."""
    s = {k: np.asarray(v, np.float32) for k, v in stats.items()}
    if pi05:
        return (state - s["q01"]) / (s["q99"] - s["q01"] + 1e-6) * 2.0 - 1.0
    return (state - s["mean"]) / (s["std"] + 1e-6)


def camera_frames(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """``[cameras, B, 224, 224, 3]`` uint8: random 8 x 8 pixel blocks (compressible) plus one row and
    one column of single-pixel noise."""
    side = shape.siglip[5]
    n = (len(CAMERAS), shape.batch)
    frames = rng.integers(0, 256, (*n, side // 8, side // 8, 3), dtype=np.uint8).repeat(8, 2).repeat(8, 3)
    frames[:, :, side // 3] = rng.integers(0, 256, (*n, side, 3), dtype=np.uint8)
    frames[:, :, :, side // 3] = rng.integers(0, 256, (*n, side, 3), dtype=np.uint8)
    return frames


def token_ids(rng: np.random.Generator, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((shape.batch, shape.max_token_len), np.int64)
    mask = np.zeros((shape.batch, shape.max_token_len), bool)
    for b, n in enumerate(shape.token_lengths):
        ids[b, 0] = 2  # PaliGemma's BOS
        ids[b, 1:n] = rng.integers(3, shape.vocab, n - 1)
        mask[b, :n] = True
    return ids, mask


class Recorder:
    """Wraps a bound method on its instance (openpi calls ``self.x(...)``) and keeps each call."""

    def __init__(self, obj, name):
        self.obj, self.name, self.inner, self.calls = obj, name, getattr(obj, name), []
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        # copies of the tensor arguments: sample_actions' timestep is a view of a tensor it then
        # updates in place (``time += dt``)
        kept = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        result = self.inner(*args, **kwargs)
        self.calls.append((kept, kwargs, result))
        return result

    def restore(self):
        delattr(self.obj, self.name)


def source_hashes(src: Path) -> dict[str, str]:
    """sha256 of the openpi files that ran (the model, its Gemma pair, the preprocessing, the replaced
    transformers files), to tell which openpi revision built the fixture."""
    files = [src / "openpi" / "models_pytorch" / f for f in ("pi0_pytorch.py", "gemma_pytorch.py",
                                                            "preprocessing_pytorch.py")]
    files += sorted((src / "openpi" / "models_pytorch" / "transformers_replace").rglob("*.py"))
    return {f.relative_to(src).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def npf(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def build(op, name: str, out_root: Path) -> None:
    shape = SHAPES[name]
    op.current["shape"] = shape
    out = out_root / name
    if out.exists():
        for f in sorted(out.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(shape.seed)
    model = op.pi0_pytorch.PI0Pytorch(model_config(shape))
    model.eval()
    randomize(model, shape.seed)
    pg = model.paligemma_with_expert.paligemma
    assert pg.lm_head.weight.data_ptr() == pg.model.language_model.embed_tokens.weight.data_ptr()

    # the converter's outputs
    import safetensors.torch

    safetensors.torch.save_model(model, str(out / "model.safetensors"))
    config = {"action_dim": shape.action_dim, "action_horizon": shape.action_horizon,
              "paligemma_variant": VARIANTS[0], "action_expert_variant": VARIANTS[1], "precision": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(100 + shape.seed)
    stats = norm_stats(rng, shape)
    stats_file = out / "assets" / ASSET_ID / "norm_stats.json"
    stats_file.parent.mkdir(parents=True)
    stats_file.write_text(json.dumps(stats, indent=2))
    (out / "tiny_sizes.json").write_text(json.dumps(sizes_json(shape), indent=2) + "\n")

    # inputs
    b, h = shape.batch, shape.action_horizon
    frames = camera_frames(rng, shape)
    images = torch.from_numpy(frames).to(torch.float32).permute(0, 1, 4, 2, 3) / 255.0 * 2.0 - 1.0
    image_masks = np.ones((len(CAMERAS), b), bool)
    image_masks[2] = False  # the right wrist: an image, masked out (openpi's LIBERO inputs)
    tokens, token_mask = token_ids(rng, shape)
    st = stats["norm_stats"]["state"]
    state_raw = (np.asarray(st["mean"]) + np.asarray(st["std"]) * rng.standard_normal((b, shape.state_dim))
                 ).astype(np.float32)
    state = np.zeros((b, shape.action_dim), np.float32)
    state[:, :shape.state_dim] = normalize_state(state_raw, st, shape.pi05)
    noise = torch.from_numpy(rng.standard_normal((b, h, shape.action_dim)).astype(np.float32))
    observation = types.SimpleNamespace(
        images={cam: images[i] for i, cam in enumerate(CAMERAS)},
        image_masks={cam: torch.from_numpy(image_masks[i]) for i, cam in enumerate(CAMERAS)},
        state=torch.from_numpy(state), tokenized_prompt=torch.from_numpy(tokens),
        tokenized_prompt_mask=torch.from_numpy(token_mask), token_ar_mask=None, token_loss_mask=None)

    prefix = Recorder(model, "embed_prefix")
    denoise = Recorder(model, "denoise_step")
    with torch.no_grad():
        actions = model.sample_actions(torch.device("cpu"), observation, noise=noise.clone(),
                                       num_steps=shape.num_steps)
    prefix.restore()
    denoise.restore()

    r = {"frames_u8": frames, "images": npf(images), "image_masks": image_masks, "tokens": tokens,
         "token_mask": token_mask, "state_raw": state_raw, "state": state, "noise": npf(noise)}
    embs, pad, _ = prefix.calls[0][2]
    r["prefix_embs"], r["prefix_pad_masks"] = npf(embs), npf(pad)
    steps = denoise.calls
    assert len(steps) == shape.num_steps, len(steps)
    assert torch.equal(steps[0][0][3], noise)
    # denoise_step(state, prefix_pad_masks, past_key_values, x_t, timestep)
    r["step_t"] = np.stack([npf(c[0][4]) for c in steps])
    r["step_x"] = np.stack([npf(c[0][3]) for c in steps])
    r["step_v"] = np.stack([npf(c[2]) for c in steps])
    r["actions"] = npf(actions)
    # PI0Pytorch.__init__ sets it to "high" (TF32 on CUDA; no effect on these CPU matmuls)
    r["float32_matmul_precision"] = np.array(torch.get_float32_matmul_precision())
    r["openpi_sources_json"] = np.array(json.dumps(source_hashes(op.src), sort_keys=True))
    npz = out_root / f"{name}_outputs.npz"
    np.savez_compressed(npz, **r)
    for f in [*out.rglob("*"), npz]:
        f.chmod(0o755 if f.is_dir() else 0o644)  # safetensors writes 0600
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{name}: {len(r)} arrays -> {npz} ({npz.stat().st_size / 1e6:.2f} MB; checkpoint {size / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=[*SHAPES, "all"])
    parser.add_argument("--src", type=Path, required=True, help="an openpi checkout (its root or src/)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    op = import_openpi(args.src)
    for name in SHAPES if args.name == "all" else [args.name]:
        build(op, name, args.out)


if __name__ == "__main__":
    main()
