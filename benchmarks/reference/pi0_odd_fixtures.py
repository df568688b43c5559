"""Two tiny pi0 / pi0.5 checkpoints whose settings are all unlike lerobot's defaults, built and run by lerobot 0.6.1.

``pi0_tiny_odd`` and ``pi05_tiny_odd`` (see :data:`ODD`): camera frames of different sizes (none at the model's),
a 100 px / patch 16 (pi0) and 64 px / patch 8 (pi0.5) SigLIP, a 7-action chunk of which 5 are executed,
4 / 5 Euler steps, 9-dim state, 6-dim action padded to 20 / 24, tokenizer lengths 23 / 40, other time-embedding
periods, one empty camera (pi0.5), and a real tokenizer saved in each checkpoint directory.

Imported from :mod:`pi0_fixtures` (same directory, never copied): how lerobot 0.6.1 is imported on Python 3.11
(:func:`~pi0_fixtures.import_lerobot`), the size overrides (:func:`~pi0_fixtures.tiny_sizes`,
``tiny_overrides.json``), the weight draws (:func:`~pi0_fixtures.randomize`, the adaRMS ``dense`` layers
included), the statistics, the loader (:func:`~pi0_fixtures.load_fixture`: lerobot's ``from_pretrained`` of the
policy and of both processor pipelines, the loaded weights checked equal to the file) and :class:`Recorder`.

The tokenizer: a byte-level BPE trained in-process by ``tokenizers`` on a fixed text (:func:`training_text`),
with PaliGemma's special ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3) and a post-processor that
prepends ``<bos>`` as PaliGemma's does, wrapped as ``transformers.PreTrainedTokenizerFast`` and written by its
``save_pretrained`` into the checkpoint directory (``tokenizer.json``, ``tokenizer_config.json``). The saved
``policy_preprocessor.json`` names ``google/paligemma-3b-pt-224``, as a real checkpoint's does; when the
fixture is run, the tokenizer step is handed ``AutoTokenizer.from_pretrained(<checkpoint dir>)`` (through
lerobot's own ``from_pretrained(overrides=...)``), so the ids and masks in the npz are lerobot's
``TokenizerProcessorStep`` running that tokenizer on the prompts lerobot built.

The run is an episode as ``lerobot-eval`` runs one: ``policy.reset()``, then :data:`CALLS` times: frames as an
env gives them (``[B, H, W, 3]`` uint8) -> ``[B, 3, H, W]`` float32 ``/ 255`` (``preprocess_observation``),
the loaded pre-processor, ``policy.select_action``, the loaded post-processor. ``n_action_steps`` 5 of a 7-action
chunk: chunks are predicted at calls 0 and 5. The noise of each chunk comes from a seeded generator through
``model.sample_noise`` (wrapped on the instance) and is recorded.

Usage (from make_pi0_fixtures.sh):
``python pi0_odd_fixtures.py {pi0_tiny_odd,pi05_tiny_odd,all} --src SRC --out assets/reference``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from pi0_fixtures import (
    Recorder,
    Shape,
    _HubTokenizerStandIn,
    dataset_stats,
    import_lerobot,
    lerobot_version,
    load_fixture,
    npf,
    randomize,
    tiny_overrides,
    tiny_sizes,
)

CALLS = 7  # select_action calls: the 5-action queue empties, a second chunk is predicted at call 5
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3, as PaliGemma's


@dataclasses.dataclass(frozen=True)
class OddShape(Shape):
    frame_hw: tuple[tuple[int, int], ...] = ()  # each camera's frames (H, W), as the env gives them
    image_resolution: int = 224
    max_state_dim: int = 32
    max_action_dim: int = 32
    empty_cameras: int = 0
    normalization: str = "MEAN_STD"  # STATE and ACTION
    min_period: float = 4e-3
    max_period: float = 4.0
    tokenizer_vocab: int = 1024  # the BPE's size (<= vocab, the model's embedding rows)
    tasks: tuple[str, ...] = ()


ODD = {
    "pi0_tiny_odd": OddShape(
        "pi0", cameras=("observation.images.cam_a", "observation.images.cam_b", "observation.images.cam_c"),
        frame_hw=((120, 160), (112, 112), (77, 53)), image_resolution=100,
        vlm=(48, 3, 96, 8, 2, 8), expert=(40, 3, 72, 8, 2, 8), siglip=(32, 2, 2, 48, 16),
        vocab=1900, tokenizer_vocab=1800, state_dim=9, action_dim=6, max_state_dim=20, max_action_dim=24,
        chunk_size=7, n_action_steps=5, num_inference_steps=4, tokenizer_max_length=23,
        normalization="QUANTILES", min_period=0.01, max_period=2.0,
        # the second prompt is longer than 23 tokens: truncated, its appended "\n" included
        tasks=("pick up the 2nd_bowl, then put it on plate #3!\n",
               "Open the top drawer.  and_stop, then close_it again; wait 10 s"), seed=10),
    "pi05_tiny_odd": OddShape(
        "pi05", cameras=("observation.images.front", "observation.images.wrist"),
        frame_hw=((96, 128), (50, 70)), image_resolution=64, empty_cameras=1,
        vlm=(40, 2, 80, 8, 1, 10), expert=(28, 2, 56, 8, 1, 10), siglip=(24, 3, 3, 40, 8),
        vocab=2400, tokenizer_vocab=2400, state_dim=9, action_dim=6, max_state_dim=20, max_action_dim=24,
        chunk_size=7, n_action_steps=5, num_inference_steps=5, tokenizer_max_length=40,
        normalization="MEAN_STD", min_period=0.02, max_period=3.0, tied_embeddings=True,
        tasks=("  Open the top drawer.  and_stop", "pick up the 2nd_bowl, then put it on plate #3!\n"), seed=11),
}


# ---------------------------------------------------------------------------------------------
# The tokenizer

INSTRUCTIONS = (
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the black bowl next to the ramekin and place it on the plate",
    "pick up the black bowl from table center and place it on the plate",
    "pick up the black bowl on the cookie box and place it on the plate",
    "pick up the black bowl in the top drawer of the wooden cabinet and place it on the plate",
    "pick up the black bowl on the ramekin and place it on the plate",
    "pick up the black bowl next to the cookie box and place it on the plate",
    "pick up the black bowl on the stove and place it on the plate",
    "pick up the black bowl next to the plate and place it on the plate",
    "pick up the black bowl on the wooden cabinet and place it on the plate",
    "open the middle drawer of the cabinet",
    "put the bowl on the stove",
    "put the wine bottle on top of the cabinet",
    "open the top drawer and put the bowl inside",
    "put the bowl on top of the cabinet",
    "push the plate to the front of the stove",
    "put the cream cheese in the bowl",
    "turn on the stove",
    "put the bowl on the plate",
    "put the wine bottle on the rack",
    "pick up the alphabet soup and place it in the basket",
    "pick up the tomato sauce and place it in the basket",
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the white mug on the left plate and put the yellow and white mug on the right plate",
    "close the microwave; then stop.",
    "Stack the red cube on the green cube!",
    "Move the 3rd block to slot #2, then release.",
    "lift_the_cup and_hold (5 s)",
)


def training_text() -> list[str]:
    """The BPE's fixed training text: robot instructions, punctuation, pi0.5 prompts with numbers -1..255,
    and seeded pseudo-words (so that a few thousand merges exist)."""
    rng = np.random.default_rng(12345)
    syllables = ("ka", "lo", "mi", "re", "tu", "sha", "po", "ne", "vi", "dra", "gle", "ost", "ump", "ar", "en",
                 "ix", "zo", "qu", "bel", "tor", "an", "st", "ing", "er", "th", "ow", "ck", "pl")
    words = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(4000)]
    lines = [" ".join(rng.choice(words, 9)) + rng.choice([".", ",", "!", "?", ";", ":", ""]) for _ in range(4000)]
    lines += [f"{s}\n" for s in INSTRUCTIONS] * 5
    lines += [f"Task: {s.replace('_', ' ')}, State: {' '.join(map(str, rng.integers(-1, 256, 8)))};\nAction: "
              for s in INSTRUCTIONS * 10]
    return lines


def make_tokenizer(size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    ids = (fast.pad_token_id, fast.eos_token_id, fast.bos_token_id, fast.unk_token_id)
    assert ids == (0, 1, 2, 3) and len(fast) == size, (ids, len(fast))
    return fast


class RecordingTokenizerProxy:
    """The checkpoint's tokenizer, called as lerobot calls it; keeps the prompts it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def __call__(self, text, **kwargs):
        self.prompts.append(list(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


# ---------------------------------------------------------------------------------------------
# Building


def make_config(lr, shape: OddShape):
    ft = lr.types
    config_cls = lr.c0.PI0Config if shape.kind == "pi0" else lr.c5.PI05Config
    inputs = {cam: ft.PolicyFeature(type=ft.FeatureType.VISUAL, shape=(3, *hw))
              for cam, hw in zip(shape.cameras, shape.frame_hw, strict=True)}
    inputs["observation.state"] = ft.PolicyFeature(type=ft.FeatureType.STATE, shape=(shape.state_dim,))
    mode = ft.NormalizationMode[shape.normalization]
    return config_cls(
        device="cpu", dtype="float32", chunk_size=shape.chunk_size, n_action_steps=shape.n_action_steps,
        num_inference_steps=shape.num_inference_steps, max_state_dim=shape.max_state_dim,
        max_action_dim=shape.max_action_dim, tokenizer_max_length=shape.tokenizer_max_length,
        image_resolution=(shape.image_resolution, shape.image_resolution), empty_cameras=shape.empty_cameras,
        min_period=shape.min_period, max_period=shape.max_period,
        normalization_mapping={"VISUAL": ft.NormalizationMode.IDENTITY, "STATE": mode, "ACTION": mode},
        input_features=inputs,
        output_features={"action": ft.PolicyFeature(type=ft.FeatureType.ACTION, shape=(shape.action_dim,))})


def save_fixture(lr, shape: OddShape, out: Path, stats) -> None:
    policy_cls = lr.m0.PI0Policy if shape.kind == "pi0" else lr.m5.PI05Policy
    make_processors = (lr.p0.make_pi0_pre_post_processors if shape.kind == "pi0"
                       else lr.p5.make_pi05_pre_post_processors)
    config = make_config(lr, shape)
    with tiny_sizes(lr, shape):
        torch.manual_seed(shape.seed)
        policy = policy_cls(config)  # validate_features adds observation.images.empty_camera_<i>
    randomize(policy, shape.seed)
    if shape.tied_embeddings:
        paligemma = policy.model.paligemma_with_expert.paligemma
        paligemma.lm_head.weight = paligemma.model.language_model.embed_tokens.weight
    policy.save_pretrained(out)
    (out / "tiny_overrides.json").write_text(json.dumps(tiny_overrides(shape), indent=2) + "\n")
    saved_tok = lr.tokenizer.AutoTokenizer
    lr.tokenizer.AutoTokenizer = _HubTokenizerStandIn  # the saved step names the hub tokenizer
    try:
        pre, post = make_processors(config, {k: {s: torch.from_numpy(v) for s, v in d.items()}
                                             for k, d in stats.items()})
    finally:
        lr.tokenizer.AutoTokenizer = saved_tok
    pre.save_pretrained(out)
    post.save_pretrained(out)
    make_tokenizer(shape.tokenizer_vocab).save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# Running


def frames_for(rng, b: int, h: int, w: int) -> np.ndarray:
    """[B, H, W, 3] uint8: random 4 x 4 pixel blocks plus one row and one column of pixel noise."""
    blocks = rng.integers(0, 256, (b, -(-h // 4), -(-w // 4), 3), dtype=np.uint8)
    frames = blocks.repeat(4, axis=1).repeat(4, axis=2)[:, :h, :w].copy()
    frames[:, rng.integers(h)] = rng.integers(0, 256, (b, w, 3), dtype=np.uint8)
    frames[:, :, rng.integers(w)] = rng.integers(0, 256, (b, h, 3), dtype=np.uint8)
    return frames


class SeededNoise:
    """``model.sample_noise``: each chunk's noise from one seeded generator, recorded."""

    def __init__(self, seed: int):
        self.generator, self.draws = torch.Generator().manual_seed(seed), []

    def __call__(self, shape, device):
        noise = torch.randn(shape, generator=self.generator, dtype=torch.float32).to(device)
        self.draws.append(noise.clone())
        return noise


def run_fixture(lr, shape: OddShape, out: Path, stats) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + shape.seed)
    tokenizer = RecordingTokenizerProxy(lr.tokenizer.AutoTokenizer.from_pretrained(str(out)))
    policy, pre, post = load_fixture(lr, shape, out, tokenizer)
    assert len(tokenizer.tokenizer) == shape.tokenizer_vocab
    config = policy.config
    assert config.image_resolution == (shape.image_resolution,) * 2, config.image_resolution
    model = policy.model
    noise = model.sample_noise = SeededNoise(2000 + shape.seed)
    recorders = {"images": Recorder(policy, "_preprocess_images"), "chunk": Recorder(policy, "predict_action_chunk"),
                 "sample": Recorder(model, "sample_actions"), "denoise": Recorder(model, "denoise_step")}
    b, tasks = shape.batch, list(shape.tasks)
    assert len(tasks) == b
    q01, q99 = stats["observation.state"]["q01"], stats["observation.state"]["q99"]
    r: dict[str, list] = {k: [] for k in ("state", "prompts", "tokens", "token_mask", "state_norm",
                                          "actions_norm", "actions")}
    frames = {cam: [] for cam in shape.cameras}
    chunk_calls = []
    policy.reset()
    for call in range(CALLS):
        obs = {}
        for cam, (h, w) in zip(shape.cameras, shape.frame_hw, strict=True):
            frames[cam].append(frames_for(rng, b, h, w))
            # lerobot.envs.utils.preprocess_observation: b h w c -> b c h w, float32, / 255
            obs[cam] = torch.from_numpy(frames[cam][-1]).permute(0, 3, 1, 2).contiguous().to(torch.float32) / 255
        state = (q01 + (q99 - q01) * rng.uniform(-0.15, 1.15, (b, shape.state_dim))).astype(np.float32)
        obs["observation.state"] = torch.from_numpy(state)
        obs["task"] = list(tasks)
        batch = pre(dict(obs))
        for cam in shape.cameras:  # VISUAL is IDENTITY: the pre-processor passes the frames through
            assert torch.equal(batch[cam], obs[cam])
        n_chunks = len(recorders["chunk"].calls)
        action = policy.select_action(batch)
        if len(recorders["chunk"].calls) > n_chunks:
            chunk_calls.append(call)
        r["state"].append(state)
        r["prompts"].append(np.array(tokenizer.prompts[-1]))
        r["tokens"].append(npf(batch["observation.language.tokens"]))
        r["token_mask"].append(npf(batch["observation.language.attention_mask"]))
        r["state_norm"].append(npf(batch["observation.state"]))
        r["actions_norm"].append(npf(action))
        r["actions"].append(npf(post(action)))
    for rec in recorders.values():
        rec.restore()
    del model.sample_noise
    assert chunk_calls == [0, shape.n_action_steps], chunk_calls

    result = {f"frames_{cam.removeprefix('observation.images.')}": np.stack(f) for cam, f in frames.items()}
    result.update({k: np.stack(v) for k, v in r.items()})
    result["tasks"] = np.array(tasks)
    result["cameras"] = np.array(shape.cameras)
    result["chunk_calls"] = np.array(chunk_calls, dtype=np.int64)
    result["noise"] = np.stack([npf(x) for x in noise.draws])
    result["images"] = np.stack([np.stack([npf(x) for x in c[2][0]]) for c in recorders["images"].calls])
    result["image_masks"] = np.stack([np.stack([npf(x) for x in c[2][1]]) for c in recorders["images"].calls])
    steps = recorders["denoise"].calls
    n, k = len(chunk_calls), shape.num_inference_steps
    assert len(steps) == n * k
    for i, draw in enumerate(noise.draws):  # each chunk's Euler loop starts from its recorded noise
        assert torch.equal(steps[i * k][1]["x_t"], draw)
    result["step_t"] = np.stack([npf(c[1]["timestep"]) for c in steps]).reshape(n, k, b)
    result["step_v"] = np.stack([npf(c[2]) for c in steps]).reshape(n, k, *steps[0][2].shape)
    result["actions_model"] = np.stack([npf(c[2]) for c in recorders["sample"].calls])
    result["chunk_norm"] = np.stack([npf(c[2]) for c in recorders["chunk"].calls])
    for i, call in enumerate(chunk_calls):  # select_action hands out the chunk's first n_action_steps
        for j in range(shape.n_action_steps if i + 1 < n else CALLS - call):
            assert np.array_equal(result["actions_norm"][call + j], result["chunk_norm"][i][:, j])
    check_result(shape, result)
    return result


def check_result(shape: OddShape, r: dict[str, np.ndarray]) -> None:
    n_cams = len(shape.cameras) + shape.empty_cameras
    res, chunks = shape.image_resolution, len(r["chunk_calls"])
    assert r["noise"].shape == (chunks, shape.batch, shape.chunk_size, shape.max_action_dim)
    assert r["images"].shape == (chunks, n_cams, shape.batch, 3, res, res), r["images"].shape
    assert r["tokens"].shape == (CALLS, shape.batch, shape.tokenizer_max_length)
    assert (r["tokens"][..., 0] == 2).all() and (r["tokens"][~r["token_mask"]] == 0).all()
    if shape.empty_cameras:
        assert (r["images"][:, -shape.empty_cameras:] == -1).all() and not r["image_masks"][:, -1].any()
    actions = r["actions_norm"]
    assert np.abs(actions).mean() > 0.1, np.abs(actions).mean()  # not degenerate
    assert np.abs(np.diff(actions, axis=0)).mean() > 0.05  # each call's action differs from the last's
    assert np.abs(r["chunk_norm"][0] - r["chunk_norm"][1]).mean() > 0.05


def build(lr, name: str, out_root: Path) -> None:
    shape = ODD[name]
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    stats = dataset_stats(np.random.default_rng(500 + shape.seed), shape)
    save_fixture(lr, shape, out, stats)
    results = run_fixture(lr, shape, out, stats)
    npz = out_root / f"{name}_outputs.npz"
    np.savez_compressed(npz, **results)
    for f in [*out.iterdir(), npz]:
        f.chmod(0o644)  # safetensors writes 0600
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {len(results)} arrays -> {npz} ({npz.stat().st_size / 1e6:.2f} MB; checkpoint "
          f"{size / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=[*ODD, "all"])
    parser.add_argument("--src", type=Path, required=True, help="directory holding lerobot/ (0.6.1)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    lr = import_lerobot(args.src)
    version = lerobot_version(lr)
    if version != "0.6.1":
        raise SystemExit(f"--src is lerobot {version}, not 0.6.1")
    for name in ODD if args.name == "all" else [args.name]:
        build(lr, name, args.out)


if __name__ == "__main__":
    main()
