"""Build tiny pi0 / pi0.5 checkpoints with lerobot 0.6.1's own code and record what it computes.

Runs in the throwaway reference venv that ``make_pi0_fixtures.sh`` makes (torch 2.13.0+cpu,
transformers 5.5.x, lerobot's own pin ``>=5.4,<5.6``), never in the project's venv, and imports
lerobot from a source tree you fetched yourself (``--src``: a directory holding ``lerobot/``, such as
the unpacked ``lerobot-0.6.1-py3-none-any.whl`` or a checkout's ``src/``).

lerobot 0.6.1 wants Python >= 3.12 and this machine has 3.11, so it is imported by hand
(:func:`import_lerobot`), changing no computation:

- two PEP 695 generic headers are rewritten, as the file is read, into their 3.11 spelling
  (``class DataProcessorPipeline[TInput, TOutput](HubMixin)`` ->
  ``class DataProcessorPipeline(HubMixin, Generic[TInput, TOutput])`` over the module's own
  ``TypeVar``s; ``def deserialize_json_into_object[T: JsonLike](...)`` loses its type parameter);
- the packages ``lerobot``, ``lerobot.policies``, ``lerobot.configs`` and ``lerobot.processor`` are
  made without running their ``__init__``; the last two are then filled with what their
  ``__init__`` imports, module by module, skipping the three modules that need torchvision
  (``configs.default``, ``processor.hil_processor``, ``processor.gym_action_processor``: none is on
  the pi0 path);
- ``lerobot.configs.train`` (the training CLI config, imported by ``policies/pretrained.py`` for a
  type annotation and ``push_to_hub``) is a stub class.

Everything else is lerobot's: ``PI0Policy`` / ``PI05Policy`` with their ``PI0Pytorch`` /
``PI05Pytorch`` models, ``pi_gemma.py``, ``common/{vla_utils,flow_matching}.py``, the processor
pipelines made by ``make_pi0_pre_post_processors`` / ``make_pi05_pre_post_processors`` and
saved / loaded by ``PolicyProcessorPipeline``, and ``save_pretrained`` / ``from_pretrained``.

Sizes (:class:`Shape`): lerobot's config only names variants (``gemma_2b`` / ``gemma_300m``), so the
module globals ``get_gemma_config``, ``PaliGemmaForConditionalGenerationWithPiGemma`` and
``PiGemmaForCausalLM`` of both modeling modules are wrapped before the policy is built: the Gemma
size table is replaced and the SigLIP sizes / vocabulary are set on the Hugging Face configs that
lerobot builds, just before its classes are constructed. The sizes are written to
``tiny_overrides.json`` beside ``config.json`` (the one file a public checkpoint does not have;
config.json itself still says ``gemma_2b`` / ``gemma_300m``).

The tokenizer: ``TokenizerProcessorStep(tokenizer_name="google/paligemma-3b-pt-224")`` loads the
gated PaliGemma tokenizer from the hub in ``__post_init__``. When the processors are made, the
module's ``AutoTokenizer`` is a stand-in, so the saved JSON names the hub tokenizer exactly as a
real checkpoint's does; when they are loaded back, ``overrides`` hands the step a
:class:`RecordingTokenizer`, which returns the fixture's fixed random ids (BOS 2, ids in
[3, vocab), right padding with 0) and records the prompt strings it was given.

Every parameter is re-drawn from one seeded generator (:func:`randomize`): weights with fan-in n as
``randn / sqrt(n)`` (embeddings by their width), 1-D tensors (biases, RMS / layer norm weights) as
``0.1 * randn``, including the adaRMS ``dense`` layers, which lerobot initialises to zero.

bfloat16 (``--dtype bfloat16``): loads the committed fp32 checkpoint directories (reads them, writes
nothing there and leaves ``<name>_outputs.npz`` alone) with lerobot's own option ``dtype="bfloat16"``
set on the saved config (so ``PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`` runs and
``load_state_dict`` rounds the fp32 weights), runs :func:`run_fixture` on the same inputs and noise
(checked equal to the fp32 npz's) and writes ``<name>_bf16_outputs.npz``: the fp32 npz's keys for the
computed quantities (:data:`BF16_KEYS`, bfloat16 values stored as float32) and ``dtypes_json``, a 0-d
string holding JSON: the state-dict names by dtype, the floating buffers (dtype, values when small:
RoPE ``inv_freq``, ``embed_scale``) and the dtypes into and out of each stage on the first inference
call (:class:`DtypeProbe`).

Usage (from make_pi0_fixtures.sh):
``python pi0_fixtures.py {pi0_tiny,pi05_tiny,pi0_tiny_1cam,pi05_tiny_1cam,all} --src SRC --out assets/reference``
``python pi0_fixtures.py all --dtype bfloat16 --src SRC --out assets/reference`` (after the fp32 run)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

TOKENIZER_NAME = "google/paligemma-3b-pt-224"

# ---------------------------------------------------------------------------------------------
# Importing lerobot 0.6.1 on Python 3.11


# (file relative to --src, text in lerobot, its Python 3.11 spelling): syntax only
SYNTAX_311 = {
    "lerobot/processor/pipeline.py": [
        ("from typing import Any, TypedDict, TypeVar, cast",
         "from typing import Any, Generic, TypedDict, TypeVar, cast"),
        ("class DataProcessorPipeline[TInput, TOutput](HubMixin):",
         "class DataProcessorPipeline(HubMixin, Generic[TInput, TOutput]):"),
    ],
    "lerobot/utils/io_utils.py": [
        ("def deserialize_json_into_object[T: JsonLike](fpath: Path, obj: T) -> T:",
         'def deserialize_json_into_object(fpath: Path, obj: "T") -> "T":'),
    ],
}
# modules lerobot's package __init__s import that need torchvision (not installed: PyPI's
# torchvision does not import with torch 2.13.0+cpu); none is used on the pi0 / pi0.5 path
TORCHVISION_ONLY = {"lerobot.configs.default", "lerobot.processor.hil_processor",
                    "lerobot.processor.gym_action_processor"}


class _Py311Loader(importlib.machinery.SourceFileLoader):
    src: Path

    def get_data(self, path):
        data = super().get_data(path)
        rel = Path(path).resolve().relative_to(self.src).as_posix() if path.endswith(".py") else None
        if rel in SYNTAX_311:
            text = data.decode()
            for old, new in SYNTAX_311[rel]:
                if text.count(old) != 1:
                    raise RuntimeError(f"{rel}: expected one {old!r}; is --src lerobot 0.6.1?")
                text = text.replace(old, new)
            data = text.encode()
        return data


class _LerobotFinder(importlib.abc.MetaPathFinder):
    def __init__(self, src: Path):
        self.src = src

    def find_spec(self, name, path, target=None):
        if name != "lerobot" and not name.startswith("lerobot."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            loader = _Py311Loader(name, spec.origin)
            loader.src = self.src
            spec.loader = loader
        return spec


def _bare_package(src: Path, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(src.joinpath(*name.split(".")))]
    sys.modules[name] = module
    return module


def _partial_package(src: Path, name: str) -> types.ModuleType:
    """The package without running its __init__, then the names its __init__ imports."""
    package = _bare_package(src, name)
    tree = ast.parse(src.joinpath(*name.split("."), "__init__.py").read_text())
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        module_name = f"{name}.{node.module}" if node.level == 1 else node.module
        if module_name in TORCHVISION_ONLY:
            continue
        module = importlib.import_module(module_name)
        for alias in node.names:
            setattr(package, alias.asname or alias.name, getattr(module, alias.name))
    return package


def import_lerobot(src: Path) -> types.SimpleNamespace:
    src = src.resolve()
    if (src / "src" / "lerobot").is_dir():
        src = src / "src"
    if not (src / "lerobot" / "lerobot_types.py").is_file():
        raise SystemExit(f"{src} is not a complete lerobot source tree (no lerobot/lerobot_types.py)")
    sys.dont_write_bytecode = True
    sys.meta_path.insert(0, _LerobotFinder(src))
    sys.path.insert(0, str(src))
    _bare_package(src, "lerobot")
    importlib.import_module("lerobot.__version__")
    train = types.ModuleType("lerobot.configs.train")
    train.TrainPipelineConfig = type("TrainPipelineConfig", (), {})  # annotation / push_to_hub only
    sys.modules[train.__name__] = train
    _partial_package(src, "lerobot.configs")
    _partial_package(src, "lerobot.processor")
    _bare_package(src, "lerobot.policies")
    mods = {}
    for key, name in {
        "version": "lerobot.__version__",
        "ltypes": "lerobot.lerobot_types",
        "types": "lerobot.configs.types",
        "policies": "lerobot.configs.policies",
        "constants": "lerobot.utils.constants",
        "pipeline": "lerobot.processor.pipeline",
        "converters": "lerobot.processor.converters",
        "tokenizer": "lerobot.processor.tokenizer_processor",
        "m0": "lerobot.policies.pi0.modeling_pi0",
        "c0": "lerobot.policies.pi0.configuration_pi0",
        "p0": "lerobot.policies.pi0.processor_pi0",
        "m5": "lerobot.policies.pi05.modeling_pi05",
        "c5": "lerobot.policies.pi05.configuration_pi05",
        "p5": "lerobot.policies.pi05.processor_pi05",
        "vla": "lerobot.policies.common.vla_utils",
    }.items():
        mods[key] = importlib.import_module(name)
    return types.SimpleNamespace(src=src, **mods)


def lerobot_version(lr) -> str:
    """The wheel's dist-info (what ``lerobot.__version__`` reads), else a checkout's pyproject.toml."""
    if lr.version.__version__ != "unknown":
        return lr.version.__version__
    for pyproject in (lr.src / "pyproject.toml", lr.src.parent / "pyproject.toml"):
        if pyproject.is_file():
            for line in pyproject.read_text().splitlines():
                if line.startswith("version = "):
                    return line.split("=", 1)[1].strip().strip('"')
    return "unknown"


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # "pi0" or "pi05"
    cameras: tuple[str, ...] = ("observation.images.image", "observation.images.image2")
    # Gemma (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim); heads must stay 8
    vlm: tuple[int, ...] = (64, 2, 128, 8, 1, 16)
    expert: tuple[int, ...] = (32, 2, 64, 8, 1, 16)
    # SigLIP (hidden, layers, heads, intermediate, patch)
    siglip: tuple[int, ...] = (32, 2, 2, 64, 14)
    vocab: int = 1024
    state_dim: int = 8
    action_dim: int = 7
    chunk_size: int = 50
    n_action_steps: int = 50
    num_inference_steps: int = 10
    tokenizer_max_length: int | None = None  # None: lerobot's default (pi0 48, pi0.5 200)
    batch: int = 2
    raw_hw: tuple[int, int] = (64, 80)  # the camera frames, HWC uint8, before resize_with_pad
    token_lengths: tuple[int, ...] = (21, 37)  # valid tokens per row, BOS included
    train_time: tuple[float, ...] = (0.3, 0.7)
    # save PaliGemma's lm_head and embed_tokens as one tied tensor, so that model.safetensors holds
    # only `...paligemma.lm_head.weight`, as the hub checkpoints converted from openpi do
    tied_embeddings: bool = False
    store_prefix_embs: bool = False  # embed_prefix's output (large at the main sizes)
    seed: int = 0


SHAPES = {
    "pi0_tiny": Shape("pi0"),
    "pi05_tiny": Shape("pi05", token_lengths=(58, 131), seed=1),
    # one camera, a 10-step chunk, batch 1, narrower stacks (head_dim 8, expert width 24 so the
    # two widths are not a power-of-two pair), a 256-id vocabulary, a tall frame (odd side padding),
    # the hub's tied lm_head / embed_tokens layout
    "pi0_tiny_1cam": Shape("pi0", cameras=("observation.images.image",), vlm=(32, 2, 64, 8, 1, 8),
                           expert=(24, 2, 48, 8, 1, 8), siglip=(16, 2, 2, 32, 14), vocab=256,
                           chunk_size=10, n_action_steps=10, batch=1, raw_hw=(90, 60),
                           token_lengths=(13,), train_time=(0.45,), tied_embeddings=True,
                           store_prefix_embs=True, seed=2),
    "pi05_tiny_1cam": Shape("pi05", cameras=("observation.images.image",), vlm=(32, 2, 64, 8, 1, 8),
                            expert=(24, 2, 48, 8, 1, 8), siglip=(16, 2, 2, 32, 14), vocab=256,
                            chunk_size=10, n_action_steps=10, tokenizer_max_length=64, batch=1,
                            raw_hw=(90, 60), token_lengths=(40,), train_time=(0.45,),
                            tied_embeddings=True, store_prefix_embs=True, seed=3),
}


@contextlib.contextmanager
def tiny_sizes(lr, shape: Shape):
    """Swap the module globals lerobot's constructors look up for the shrunk sizes."""
    saved = []
    for m in (lr.m0, lr.m5):
        table = {"gemma_2b": m.GemmaConfig(*shape.vlm), "gemma_300m": m.GemmaConfig(*shape.expert)}
        vlm_cls, expert_cls = m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM

        def vlm(config, _cls=vlm_cls):
            v = config.vision_config
            (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size,
             v.patch_size) = shape.siglip
            v.projection_dim = config.text_config.hidden_size  # lerobot: 2048 (gemma_2b's width)
            config.text_config.vocab_size = shape.vocab
            config._vocab_size = config.image_token_index = shape.vocab  # lerobot: 257152 for both
            return _cls(config)

        def expert(config, _cls=expert_cls):
            config.vocab_size = shape.vocab
            return _cls(config)

        saved.append((m, m.get_gemma_config, vlm_cls, expert_cls))
        m.get_gemma_config = table.__getitem__
        m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM = vlm, expert
    try:
        yield
    finally:
        for m, get, vlm_cls, expert_cls in saved:
            m.get_gemma_config = get
            m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM = vlm_cls, expert_cls


def tiny_overrides(shape: Shape) -> dict:
    keys = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
    return {
        "comment": "Sizes this tiny fixture was built with in place of lerobot's gemma_2b / gemma_300m / "
                   "SigLIP so400m / 257152-id vocabulary (config.json still names the variants).",
        "paligemma_variant": dict(zip(keys, shape.vlm, strict=True)),
        "action_expert_variant": dict(zip(keys, shape.expert, strict=True)),
        "vision_config": dict(zip(("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size", "patch_size"), shape.siglip, strict=True),
                              projection_dim=shape.vlm[0]),
        "vocab_size": shape.vocab,
    }


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


# ---------------------------------------------------------------------------------------------
# Stats, tokenizer, inputs


def dataset_stats(rng: np.random.Generator, shape: Shape) -> dict[str, dict[str, np.ndarray]]:
    def vector(n):
        mean = rng.normal(0.0, 0.5, n)
        std = rng.uniform(0.1, 1.0, n)
        q01 = mean - std * rng.uniform(1.8, 2.6, n)
        q99 = mean + std * rng.uniform(1.8, 2.6, n)
        lo = q01 - std * rng.uniform(0.05, 0.8, n)
        hi = q99 + std * rng.uniform(0.05, 0.8, n)
        return {k: v.astype(np.float32) for k, v in
                dict(mean=mean, std=std, min=lo, max=hi, q01=q01, q99=q99).items()}

    def image():
        mean = rng.uniform(0.3, 0.6, (3, 1, 1))
        std = rng.uniform(0.15, 0.3, (3, 1, 1))
        return {k: v.astype(np.float32) for k, v in dict(
            mean=mean, std=std, min=np.zeros((3, 1, 1)), max=np.ones((3, 1, 1)),
            q01=mean - 2 * std * 0.9, q99=mean + 2 * std * 0.9).items()}

    stats = {cam: image() for cam in shape.cameras}
    stats["observation.state"] = vector(shape.state_dim)
    stats["action"] = vector(shape.action_dim)
    return stats


class _HubTokenizerStandIn:
    """What ``AutoTokenizer`` is while the processors are made (the step keeps only the name)."""

    @staticmethod
    def from_pretrained(name, *args, **kwargs):
        assert name == TOKENIZER_NAME, name
        return object()


class RecordingTokenizer:
    """Returns fixed ids / masks of the tokenizer's output type; records the prompts."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray):
        self.ids, self.mask, self.prompts = ids, mask, []

    def __call__(self, text, *, max_length, truncation, padding, padding_side, return_tensors):
        assert (padding, padding_side, truncation, return_tensors) == ("max_length", "right", True, "pt")
        assert max_length == self.ids.shape[1] and len(text) == self.ids.shape[0]
        self.prompts.append(list(text))
        return {"input_ids": torch.from_numpy(self.ids.copy()),
                "attention_mask": torch.from_numpy(self.mask.astype(np.int64))}


def token_ids(rng, shape: Shape, length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((shape.batch, length), np.int64)
    mask = np.zeros((shape.batch, length), bool)
    for b, n in enumerate(shape.token_lengths):
        ids[b, 0] = 2  # PaliGemma's BOS
        ids[b, 1:n] = rng.integers(3, shape.vocab, n - 1)
        mask[b, :n] = True
    return ids, mask


def camera_frames(rng, shape: Shape) -> np.ndarray:
    """[cameras, B, H, W, 3] uint8: random 8 x 8 pixel blocks (the resize interpolates across the
    block edges; the constant block insides keep the stored 224 x 224 float images compressible)
    plus one row and one column of single-pixel noise."""
    h, w = shape.raw_hw
    n = (len(shape.cameras), shape.batch)
    blocks = rng.integers(0, 256, (*n, -(-h // 8), -(-w // 8), 3), dtype=np.uint8)
    frames = blocks.repeat(8, axis=2).repeat(8, axis=3)[:, :, :h, :w].copy()
    frames[:, :, h // 3] = rng.integers(0, 256, (*n, w, 3), dtype=np.uint8)
    frames[:, :, :, w // 3] = rng.integers(0, 256, (*n, h, 3), dtype=np.uint8)
    return frames


# tasks for the pi0.5 prompt rows and the fixed normalised states they are built with
PI05_PROMPT_TASKS = [
    "pick_up the black_bowl\nand place_it on the plate",
    "  open the top drawer of the cabinet  ",
    "put_both_the_alphabet_soup_and_the_tomato_sauce_in_the_basket\n",
    "turn on the stove",
]
PI05_PROMPT_STATES = np.array([
    [-1.0, 0.99, 1.0, -1e-30, 0.9921875, 0.0, -0.9921875, 0.5],
    [-1.5, 2.0, -1.0000001, 0.99218744, 1e-30, -0.0078125, 0.0078125, -0.5],
    [0.1, -0.1, 0.33, -0.33, 0.66, -0.66, 0.999, -0.999],
    [-1.0, -1.0, 1.0, 1.0, -1e-30, -1e-30, 0.9921875, 0.9921875],
], dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Building and running


def make_config(lr, shape: Shape):
    ft = lr.types
    config_cls = lr.c0.PI0Config if shape.kind == "pi0" else lr.c5.PI05Config
    input_features = {cam: ft.PolicyFeature(type=ft.FeatureType.VISUAL, shape=(3, 224, 224))
                      for cam in shape.cameras}
    input_features["observation.state"] = ft.PolicyFeature(type=ft.FeatureType.STATE, shape=(shape.state_dim,))
    extra = {} if shape.tokenizer_max_length is None else {"tokenizer_max_length": shape.tokenizer_max_length}
    return config_cls(
        device="cpu", dtype="float32", chunk_size=shape.chunk_size, n_action_steps=shape.n_action_steps,
        num_inference_steps=shape.num_inference_steps, input_features=input_features,
        output_features={"action": ft.PolicyFeature(type=ft.FeatureType.ACTION, shape=(shape.action_dim,))},
        **extra)


def save_fixture(lr, shape: Shape, out: Path, stats) -> None:
    policy_cls = lr.m0.PI0Policy if shape.kind == "pi0" else lr.m5.PI05Policy
    make_processors = (lr.p0.make_pi0_pre_post_processors if shape.kind == "pi0"
                       else lr.p5.make_pi05_pre_post_processors)
    config = make_config(lr, shape)
    with tiny_sizes(lr, shape):
        torch.manual_seed(shape.seed)
        policy = policy_cls(config)
    randomize(policy, shape.seed)
    if shape.tied_embeddings:
        paligemma = policy.model.paligemma_with_expert.paligemma
        paligemma.lm_head.weight = paligemma.model.language_model.embed_tokens.weight
    policy.save_pretrained(out)
    (out / "tiny_overrides.json").write_text(json.dumps(tiny_overrides(shape), indent=2) + "\n")
    saved_tok = lr.tokenizer.AutoTokenizer
    lr.tokenizer.AutoTokenizer = _HubTokenizerStandIn
    try:
        pre, post = make_processors(config, {k: {s: torch.from_numpy(v) for s, v in d.items()}
                                             for k, d in stats.items()})
    finally:
        lr.tokenizer.AutoTokenizer = saved_tok
    pre.save_pretrained(out)
    post.save_pretrained(out)


def load_fixture(lr, shape: Shape, out: Path, tokenizer: RecordingTokenizer, dtype: str = "float32"):
    policy_cls = lr.m0.PI0Policy if shape.kind == "pi0" else lr.m5.PI05Policy
    config = None
    if dtype != "float32":
        # the saved config.json (dtype "float32") with lerobot's own `dtype` option changed, as a user
        # would run the checkpoint in bfloat16; the fp32 weights are cast as load_state_dict copies them
        config = lr.policies.PreTrainedConfig.from_pretrained(out)
        config.dtype = dtype
    with tiny_sizes(lr, shape), contextlib.redirect_stdout(sys.stderr):
        policy = policy_cls.from_pretrained(out, config=config)
    policy.eval()
    # what from_pretrained loaded is the file (lerobot prints, rather than raises, on a failed load)
    from safetensors.torch import load_file
    saved, loaded = load_file(out / "model.safetensors"), policy.state_dict()
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    if shape.tied_embeddings:
        assert embed not in saved
        saved[embed] = saved["model.paligemma_with_expert.paligemma.lm_head.weight"]
    assert saved.keys() == loaded.keys(), saved.keys() ^ loaded.keys()
    assert all(torch.equal(saved[k].to(loaded[k].dtype), loaded[k]) for k in saved)
    pipeline = lr.pipeline.PolicyProcessorPipeline
    pre = pipeline.from_pretrained(out, config_filename="policy_preprocessor.json",
                                   overrides={"tokenizer_processor": {"tokenizer": tokenizer}})
    post = pipeline.from_pretrained(out, config_filename="policy_postprocessor.json",
                                    to_transition=lr.converters.policy_action_to_transition,
                                    to_output=lr.converters.transition_to_policy_action)
    return policy, pre, post


class Recorder:
    """Wraps a bound method on its instance (lerobot calls ``self.x(...)``) and keeps each call."""

    def __init__(self, obj, name):
        self.obj, self.name, self.inner, self.calls = obj, name, getattr(obj, name), []
        self.outer = obj.__dict__.get(name)  # a Recorder already there (DtypeProbe's), else None
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        result = self.inner(*args, **kwargs)
        self.calls.append((args, kwargs, result))
        return result

    def restore(self):
        if self.outer is None:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.outer)


def npf(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds every bfloat16 value exactly
        t = t.float()
    return t.detach().cpu().numpy().copy()


def run_fixture(lr, shape: Shape, out: Path, stats, dtype: str = "float32",
                probe=None) -> dict[str, np.ndarray]:
    """Load the checkpoint in ``out`` (lerobot's ``dtype`` option: "float32" or "bfloat16") and run it
    on the fixture's inputs; ``probe(policy)``, when given, is called once the policy is loaded and
    returns a callable that is called after the inference (it must change nothing)."""
    rng = np.random.default_rng(1000 + shape.seed)
    config = json.loads((out / "config.json").read_text())
    length = config["tokenizer_max_length"]
    ids, mask = token_ids(rng, shape, length)
    tokenizer = RecordingTokenizer(ids, mask)
    policy, pre, post = load_fixture(lr, shape, out, tokenizer, dtype)
    model = policy.model
    probe_done = probe(policy) if probe is not None else None
    b, chunk = shape.batch, shape.chunk_size
    r = {}

    # observation: frames -> [B,3,H,W] float32 in [0, 1] as lerobot.envs.utils.preprocess_observation
    frames = camera_frames(rng, shape)
    r["frames_u8"] = frames
    q01, q99 = stats["observation.state"]["q01"], stats["observation.state"]["q99"]
    state = (q01 + (q99 - q01) * rng.uniform(-0.15, 1.15, (b, shape.state_dim))).astype(np.float32)
    tasks = ["pick_up the black bowl\nplace it on the plate", "  open the_top drawer "][:b]
    obs = {cam: torch.from_numpy(frames[i]).permute(0, 3, 1, 2).contiguous().to(torch.float32) / 255
           for i, cam in enumerate(shape.cameras)}
    obs["observation.state"] = torch.from_numpy(state)
    obs["task"] = list(tasks)
    r["state"], r["tasks"] = state, np.array(tasks)

    batch = pre(dict(obs))
    r["prompts"] = np.array(tokenizer.prompts[-1])  # the strings the tokenizer step was given
    r["tokens"] = npf(batch["observation.language.tokens"])
    r["token_mask"] = npf(batch["observation.language.attention_mask"])
    assert (r["tokens"] == ids).all() and (r["token_mask"] == mask).all()
    r["state_norm"] = npf(batch["observation.state"])

    images, img_masks = policy._preprocess_images(batch)
    r["images"] = np.stack([npf(x) for x in images])  # [cameras, B, 3, 224, 224]
    r["image_masks"] = np.stack([npf(x) for x in img_masks])

    noise = torch.from_numpy(rng.standard_normal((b, chunk, 32)).astype(np.float32))
    r["noise"] = npf(noise)
    recorders = [Recorder(model, "embed_prefix"), Recorder(model.paligemma_with_expert, "forward"),
                 Recorder(model, "denoise_step"), Recorder(model, "sample_actions")]
    actions7 = policy.predict_action_chunk(batch, noise=noise)
    for rec in recorders:
        rec.restore()
    if probe_done is not None:
        probe_done()
    embed_prefix, pwe_forward, denoise, sample = recorders
    prefix_embs, prefix_pad, _ = embed_prefix.calls[0][2]
    r["prefix_pad_masks"] = npf(prefix_pad)
    if shape.store_prefix_embs:
        r["prefix_embs"] = npf(prefix_embs)
    assert pwe_forward.calls[0][1]["use_cache"] and pwe_forward.calls[0][1]["inputs_embeds"][1] is None
    cache = pwe_forward.calls[0][2][1]
    depth = shape.vlm[1]
    for layer, tag in ((0, "layer0"), (depth - 1, "last")):
        r[f"prefix_k_{tag}"] = npf(cache.layers[layer].keys)
        r[f"prefix_v_{tag}"] = npf(cache.layers[layer].values)
    steps = denoise.calls
    assert len(steps) == shape.num_inference_steps
    # step k: t = step_t[k], x_in = noise (k = 0) or step_x_out[k - 1], v = step_v[k]
    assert torch.equal(steps[0][1]["x_t"], noise)
    r["step_t"] = np.stack([npf(c[1]["timestep"]) for c in steps])
    r["step_v"] = np.stack([npf(c[2]) for c in steps])
    x_out = [c[1]["x_t"] for c in steps[1:]] + [sample.calls[0][2]]
    r["step_x_out"] = np.stack([npf(x) for x in x_out])
    r["actions_model"] = npf(sample.calls[0][2])
    r["actions_norm"] = npf(actions7)
    r["actions"] = npf(post(actions7))

    # training forward: fixed noise and time, target actions normalised by the preprocessor
    qa01, qa99 = stats["action"]["q01"], stats["action"]["q99"]
    target = (qa01 + (qa99 - qa01) * rng.uniform(0, 1, (b, chunk, shape.action_dim))).astype(np.float32)
    train_batch = pre({**obs, "action": torch.from_numpy(target)})
    train_noise = torch.from_numpy(rng.standard_normal((b, chunk, 32)).astype(np.float32))
    train_time = torch.tensor(shape.train_time, dtype=torch.float32)
    r["train_actions"], r["train_actions_norm"] = target, npf(train_batch["action"])
    r["train_noise"], r["train_time"] = npf(train_noise), npf(train_time)
    images, img_masks = policy._preprocess_images(train_batch)
    padded = policy.prepare_action(train_batch)
    with torch.no_grad():
        if shape.kind == "pi0":
            loss = model.forward(images, img_masks, train_batch["observation.language.tokens"],
                                 train_batch["observation.language.attention_mask"],
                                 policy.prepare_state(train_batch), padded, train_noise, train_time)
        else:
            loss = model.forward(images, img_masks, train_batch["observation.language.tokens"],
                                 train_batch["observation.language.attention_mask"], padded,
                                 train_noise, train_time)
        r["train_loss"] = npf(loss)  # [B, chunk, 32], F.mse_loss(u_t, v_t, reduction="none")
        # the policy's own forward with the same draws: crop to the action dim, mean
        model.sample_noise = lambda shape_, device: train_noise.clone()
        model.sample_time = lambda bsize, device: train_time.clone()
        policy_loss, _ = policy.forward(train_batch)
        del model.sample_noise, model.sample_time
    r["train_loss_mean"] = npf(policy_loss)

    if shape.kind == "pi05":
        step = lr.p5.Pi05PrepareStateTokenizerProcessorStep(max_state_dim=config["max_state_dim"])
        key = lr.ltypes.TransitionKey
        transition = lr.converters.create_transition(
            observation={"observation.state": torch.from_numpy(PI05_PROMPT_STATES)},
            complementary_data={"task": list(PI05_PROMPT_TASKS)})
        built = step(transition)[key.COMPLEMENTARY_DATA]["task"]
        r["prompt_states"], r["prompt_tasks"] = PI05_PROMPT_STATES, np.array(PI05_PROMPT_TASKS)
        r["prompt_strings"] = np.array(built)
    return r


def build(lr, name: str, out_root: Path) -> None:
    shape = SHAPES[name]
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    stats = dataset_stats(np.random.default_rng(500 + shape.seed), shape)
    save_fixture(lr, shape, out, stats)
    results = run_fixture(lr, shape, out, stats)
    np.savez_compressed(out_root / f"{name}_outputs.npz", **results)
    for f in [*out.iterdir(), out_root / f"{name}_outputs.npz"]:
        f.chmod(0o644)  # safetensors writes 0600
    npz = out_root / f"{name}_outputs.npz"
    size = sum(f.stat().st_size for f in out.iterdir()) + npz.stat().st_size
    print(f"{name}: {len(results)} arrays -> {npz} ({size / 1e6:.2f} MB with the checkpoint)")


# what the bfloat16 run stores: the fp32 npz's keys for what the network computes (the inputs are
# the fp32 run's, checked equal, and are not repeated)
BF16_KEYS = ("prefix_embs", "prefix_k_layer0", "prefix_v_layer0", "prefix_k_last", "prefix_v_last",
             "step_t", "step_v", "step_x_out", "actions_model", "actions_norm", "actions",
             "train_loss", "train_loss_mean")
# inputs the bfloat16 run must share with the committed fp32 npz
SHARED_INPUTS = ("frames_u8", "state", "prompts", "tokens", "token_mask", "state_norm", "images",
                 "image_masks", "noise", "prefix_pad_masks", "train_actions_norm", "train_noise",
                 "train_time")


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dtypes(obj):
    """The dtypes of the tensors in a module's inputs / outputs (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        return _dtype_name(obj)
    if isinstance(obj, (tuple, list)):
        return [_dtypes(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _dtypes(v) for k, v in obj.items() if v is not None and not isinstance(v, (bool, int, float))}
    if hasattr(obj, "layers") and hasattr(obj, "get_seq_length"):  # a transformers Cache
        return {"keys": _dtype_name(obj.layers[0].keys), "values": _dtype_name(obj.layers[0].values)}
    return type(obj).__name__


class DtypeProbe:
    """Records, for the bfloat16 run, the dtype of every parameter and floating buffer after loading,
    and the dtypes going into and out of each stage on the first call of the inference (hooks and
    wrappers that only look)."""

    def __init__(self, lr, shape: Shape):
        self.lr, self.shape, self.trace, self.info = lr, shape, {}, {}

    def _keep(self, name, **entry):
        self.trace.setdefault(name, entry)

    def __call__(self, policy):
        lr, model = self.lr, policy.model
        by_dtype: dict[str, list[str]] = {}
        for name, t in policy.state_dict().items():
            if t.is_floating_point():
                by_dtype.setdefault(_dtype_name(t), []).append(name)
        buffers = {}
        for name, b in policy.named_buffers(remove_duplicate=False):
            if b.is_floating_point():
                buffers[name] = {"dtype": _dtype_name(b), "persistent": name in policy.state_dict(),
                                 **({"values": b.float().flatten().tolist()} if b.numel() <= 64 else {})}
        self.info = {"state_dict_by_dtype": by_dtype, "float_buffers": buffers}

        pwe = model.paligemma_with_expert
        vlm, expert = pwe.paligemma.model.language_model, pwe.gemma_expert.model
        names = {"vision_tower": pwe.paligemma.model.vision_tower,
                 "multi_modal_projector": pwe.paligemma.model.multi_modal_projector,
                 "vlm.embed_tokens": vlm.embed_tokens, "vlm.rotary_emb": vlm.rotary_emb}
        for tag, stack in (("vlm", vlm), ("expert", expert)):
            layer = stack.layers[0]
            names.update({f"{tag}.layers.0": layer, f"{tag}.layers.0.input_layernorm": layer.input_layernorm,
                          f"{tag}.layers.0.self_attn": layer.self_attn,
                          f"{tag}.layers.0.self_attn.q_proj": layer.self_attn.q_proj,
                          f"{tag}.layers.0.self_attn.o_proj": layer.self_attn.o_proj,
                          f"{tag}.layers.0.post_attention_layernorm": layer.post_attention_layernorm,
                          f"{tag}.layers.0.mlp": layer.mlp, f"{tag}.norm": stack.norm})
        names["expert.rotary_emb"] = expert.rotary_emb
        heads = (("state_proj", "action_in_proj", "action_time_mlp_in", "action_time_mlp_out")
                 if self.shape.kind == "pi0" else ("action_in_proj", "time_mlp_in", "time_mlp_out"))
        names.update({h: getattr(model, h) for h in (*heads, "action_out_proj")})
        handles = []
        for name, module in names.items():
            def hook(module, args, kwargs, output, name=name):
                self._keep(name, args=_dtypes(list(args)), kwargs=_dtypes(kwargs), out=_dtypes(output))
            handles.append(module.register_forward_hook(hook, with_kwargs=True))

        attn_names = {id(vlm.layers[0].self_attn): "vlm.layers.0", id(expert.layers[0].self_attn): "expert.layers.0"}
        gemma = lr.m0.modeling_gemma
        eager = gemma.eager_attention_forward

        def attention(module, query, key, value, attention_mask, scaling, *args, **kwargs):
            output, weights = eager(module, query, key, value, attention_mask, scaling, *args, **kwargs)
            if id(module) in attn_names:
                self._keep(f"{attn_names[id(module)]}.eager_attention_forward",
                           args=_dtypes([query, key, value, attention_mask]), scaling=scaling,
                           out=_dtypes([output, weights]))
            return output, weights

        gemma.eager_attention_forward = attention  # looked up by GemmaAttention.forward at each call
        sinusoid = {m: m.create_sinusoidal_pos_embedding for m in (lr.m0, lr.m5)}

        def time_embedding(time, *args, _f=sinusoid[lr.m0], **kwargs):
            result = _f(time, *args, **kwargs)
            self._keep("create_sinusoidal_pos_embedding", args=[_dtype_name(time)], out=_dtype_name(result))
            return result

        for m in sinusoid:
            m.create_sinusoidal_pos_embedding = time_embedding
        recorders = [Recorder(pwe, "embed_image"), Recorder(pwe, "embed_language_tokens"),
                     Recorder(model, "embed_prefix"), Recorder(model, "denoise_step"),
                     Recorder(model, "sample_actions")]

        def done():
            for h in handles:
                h.remove()
            gemma.eager_attention_forward = eager
            for m, f in sinusoid.items():
                m.create_sinusoidal_pos_embedding = f
            for rec in recorders:
                rec.restore()
                args, kwargs, result = rec.calls[0]
                self._keep(f"{type(rec.obj).__name__}.{rec.name}", args=_dtypes(list(args)),
                           kwargs=_dtypes(kwargs), out=_dtypes(result))
        return done


def build_bf16(lr, name: str, out_root: Path) -> None:
    """Run the committed fp32 checkpoint ``out_root/name`` (read, never rewritten) with lerobot's
    ``dtype="bfloat16"`` on the fp32 run's inputs and noise; write ``<name>_bf16_outputs.npz``."""
    shape = SHAPES[name]
    out = out_root / name
    fp32_npz = out_root / f"{name}_outputs.npz"
    if not (out / "model.safetensors").is_file() or not fp32_npz.is_file():
        raise SystemExit(f"{out} / {fp32_npz}: build the float32 fixture first")
    stats = dataset_stats(np.random.default_rng(500 + shape.seed), shape)
    probe = DtypeProbe(lr, shape)
    results = run_fixture(lr, shape, out, stats, dtype="bfloat16", probe=probe)
    with np.load(fp32_npz) as ref:
        for key in SHARED_INPUTS:
            assert np.array_equal(results[key], ref[key]), f"{name}: {key} differs from the fp32 run's"
        kept = {k: results[k] for k in BF16_KEYS if k in results}
        assert {k for k in BF16_KEYS if k in ref} == kept.keys(), kept.keys()
    for k, v in kept.items():
        assert v.dtype == np.float32, (k, v.dtype)
    kept["dtypes_json"] = np.array(json.dumps(
        {"lerobot_dtype": "bfloat16", **probe.info, "first_call_dtypes": probe.trace}, sort_keys=True))
    npz = out_root / f"{name}_bf16_outputs.npz"
    np.savez_compressed(npz, **kept)
    npz.chmod(0o644)
    print(f"{name}: {len(kept)} arrays -> {npz} ({npz.stat().st_size / 1e6:.2f} MB)")


def dump_layout(lr, kind: str, out_root: Path) -> None:
    """The public 3B network's tensors (lerobot's default sizes: gemma_2b, gemma_300m, SigLIP so400m),
    ``{name: shape}`` as a downloaded ``model.safetensors`` holds them, built on the meta device."""
    ft = lr.types
    config_cls, policy_cls = (lr.c0.PI0Config, lr.m0.PI0Policy) if kind == "pi0" else (lr.c5.PI05Config,
                                                                                       lr.m5.PI05Policy)
    inputs = {cam: ft.PolicyFeature(type=ft.FeatureType.VISUAL, shape=(3, 224, 224))
              for cam in ("observation.images.image", "observation.images.image2")}
    inputs["observation.state"] = ft.PolicyFeature(type=ft.FeatureType.STATE, shape=(8,))
    config = config_cls(device="cpu", dtype="float32", input_features=inputs,
                        output_features={"action": ft.PolicyFeature(type=ft.FeatureType.ACTION, shape=(7,))})
    move = torch.nn.Module.to
    torch.nn.Module.to = lambda module, *args, **kwargs: module  # the policy moves itself to config.device
    try:
        with torch.device("meta"):
            policy = policy_cls(config)
    finally:
        torch.nn.Module.to = move
    shapes = {k: list(v.shape) for k, v in policy.state_dict().items()}
    path = out_root / f"{kind}_3b_layout.json"
    path.write_text(json.dumps(shapes, indent=0, sort_keys=True) + "\n")
    print(f"{kind}: {len(shapes)} tensors -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=[*SHAPES, "all", "layouts"],
                        help="a fixture, all of them, or the 3B layouts (pi0_3b_layout.json, pi05_3b_layout.json)")
    parser.add_argument("--src", type=Path, required=True, help="directory holding lerobot/ (0.6.1)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: run the existing fp32 checkpoint(s) with lerobot's dtype='bfloat16' and "
                             "write <name>_bf16_outputs.npz (the checkpoints and fp32 outputs are not touched)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    lr = import_lerobot(args.src)
    version = lerobot_version(lr)
    if version != "0.6.1":
        raise SystemExit(f"--src is lerobot {version}, not 0.6.1")
    if args.name == "layouts":
        if args.dtype != "float32":
            parser.error("layouts take no --dtype")
        for kind in ("pi0", "pi05"):
            dump_layout(lr, kind, args.out)
        return
    for name in SHAPES if args.name == "all" else [args.name]:
        if args.dtype == "bfloat16":
            build_bf16(lr, name, args.out)
        else:
            build(lr, name, args.out)


if __name__ == "__main__":
    main()
