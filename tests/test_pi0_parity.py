"""pi0 / pi0.5 against lerobot 0.6.1, on tiny random-weight checkpoints lerobot itself built and ran
(assets/reference/pi0*_tiny*, benchmarks/reference/make_pi0_fixtures.sh): given the same inputs and
noise, our images, prompts, normalised states, prefix keys and values, every Euler step's velocity,
the action chunk, the un-normalised actions and the flow-matching loss equal theirs (fp32, 1e-5); in
bfloat16, the same parameters in each dtype and each step's velocity. Against openpi's own PyTorch
model too (assets/reference/openpi_pi0*_tiny, benchmarks/reference/make_openpi_fixtures.sh), read in
openpi's checkpoint layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from policies.flow_steps import accumulated_time_grid
from policies.pi0.checkpoint import our_names, read_checkpoint
from policies.pi0.inputs import pad_to, pi0_prompt, pi05_prompt, vision_input
from policies.pi0.model import PiZero, Prefix
from policies.pi0.transformer import additive, attention_mask_2d
from tests.reference import ASSETS

# fixture -> SigLIP's head size there (the tensors do not show it)
FIXTURES = {"pi0_tiny": 16, "pi05_tiny": 16, "pi0_tiny_1cam": 8, "pi05_tiny_1cam": 8}
TOL = dict(rtol=1e-5, atol=1e-5)

# bfloat16 against lerobot's bfloat16 run, made on another CPU. bfloat16 keeps 8 significant bits: the bf16 numbers
# either side of x are at most BF16_EPS * |x| apart (one ulp; rounding to nearest errs by at most half of it, 2^-8).
# Two CPUs' runs differ only where a float32 result whose last bits their kernels get differently (vector width,
# summation order, AVX512-BF16 / AMX dot products; ATEN_CPU_CAPABILITY picks among them) lies on the other side of
# a bf16 rounding point: one ulp there, which the RMSNorm opening every block carries on at the scale of what
# follows. So a compared tensor may move by one ulp of its largest magnitude per bf16 rounding in series on its path:
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps
KV_ROUNDINGS = 5  # a layer's keys from that layer's input: input norm, projection, RoPE (cos / sin, products, sum)
STREAM_ROUNDINGS = 2  # per decoder layer the residual stream is rounded twice: after attention, after the MLP
# The velocity: both stacks' layers (the expert attends to every VLM layer's keys) and the expert's final norm; the
# float32 action_out_proj adds none. Measured when this was written, in units of BF16_EPS * max|reference| (bounds:
# 5 for layer-0 keys / values, 7 for the last layer's, 9 for the velocity): ATEN_CPU_CAPABILITY default / avx2 /
# avx512 moved one step's velocity by up to 0.41 and nothing else; our float32 network, which rounds nothing, is
# 2.8, 2.9 and 1.3 away (the test checks the velocity's on the CPU it runs on). A time off by 0.01, a skipped expert
# layer or VLM MLP, Gemma's (1 + w) norm weight read as w, or a norm eps of 1e-2 lands 10 to 135 away; a norm eps
# of 1e-3 (at most 4 away) is left to the float32 tests.


def _close(ours: torch.Tensor, theirs: np.ndarray, what: str) -> None:
    torch.testing.assert_close(ours, torch.from_numpy(np.asarray(theirs)), **TOL, msg=lambda m: f"{what}: {m}")


def _close_bf16(ours: torch.Tensor, theirs: np.ndarray | torch.Tensor, roundings: int, what: str) -> None:
    """Within ``roundings`` bfloat16 ulps of the reference's largest magnitude (see BF16_EPS)."""
    theirs = torch.from_numpy(np.asarray(theirs))
    atol = roundings * BF16_EPS * theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=atol, msg=lambda m: f"{what} ({roundings} bf16 ulps): {m}")


@pytest.fixture(scope="module", params=list(FIXTURES))
def case(request):
    name = request.param
    ckpt = read_checkpoint(ASSETS / name, vision_head_dim=FIXTURES[name])
    model = PiZero(ckpt.size).eval()
    model.load_state_dict(ckpt.tensors(), strict=True)
    return name, ckpt, model, dict(np.load(ASSETS / f"{name}_outputs.npz"))


def _inputs(ckpt, model, ref):
    """Our pre-processing of the fixture's raw frames, state and (given) prompt tokens."""
    frames = torch.from_numpy(ref["frames_u8"]).permute(0, 1, 4, 2, 3).float() / 255  # [cams, B, 3, H, W]
    images = [vision_input(f, ckpt.size.vision.image_size) for f in frames]
    masks = [torch.ones(f.shape[0], dtype=torch.bool) for f in frames]
    tokens, token_masks = torch.from_numpy(ref["tokens"]), torch.from_numpy(ref["token_mask"])
    state = ckpt.state.normalize(torch.from_numpy(ref["state"]))
    return images, masks, tokens, token_masks, state


@torch.no_grad()
def test_images_prompts_and_states_are_prepared_as_lerobot_does(case):
    name, ckpt, model, ref = case
    images, _, _, _, state = _inputs(ckpt, model, ref)
    _close(torch.stack(images), ref["images"], "images")
    _close(state, ref["state_norm"], "normalised state")
    if ckpt.size.pi05:
        prompts = [pi05_prompt(task, s) for task, s in zip(ref["tasks"], state, strict=True)]
        extra = [pi05_prompt(str(t), torch.from_numpy(s)) for t, s in zip(ref["prompt_tasks"], ref["prompt_states"],
                                                                          strict=True)]
        assert extra == list(ref["prompt_strings"])
        assert pi05_prompt(" open_the\ndrawer ", None) == "open the drawer\n"  # openpi's pi05_libero: no state
    else:
        prompts = [pi0_prompt(str(task)) for task in ref["tasks"]]
    assert prompts == list(ref["prompts"])


@torch.no_grad()
def test_prefix_velocities_and_actions_equal_lerobots(case):
    name, ckpt, model, ref = case
    images, masks, tokens, token_masks, state = _inputs(ckpt, model, ref)
    prefix = model.prefix(images, masks, tokens, token_masks)
    assert torch.equal(prefix.pad, torch.from_numpy(ref["prefix_pad_masks"]))
    for layer, tag in ((0, "layer0"), (-1, "last")):
        _close(prefix.kv[layer][0], ref[f"prefix_k_{tag}"], f"prefix keys, {tag}")
        _close(prefix.kv[layer][1], ref[f"prefix_v_{tag}"], f"prefix values, {tag}")
    padded_state = None if ckpt.size.pi05 else pad_to(state, ckpt.size.max_state_dim)
    x = torch.from_numpy(ref["noise"])
    steps = int(ckpt.config["num_inference_steps"])
    for k in range(steps):  # each step from lerobot's own input, so a wrong step is named, not smeared
        t = torch.from_numpy(ref["step_t"][k])
        v = model.velocity(prefix, padded_state, x, t)
        _close(v, ref["step_v"][k], f"velocity at step {k}")
        x = torch.from_numpy(ref["step_x_out"][k])
    chunk = model.sample(prefix, padded_state, torch.from_numpy(ref["noise"]), steps)
    _close(chunk, ref["actions_model"], "action chunk")
    _close(ckpt.action.unnormalize(chunk[..., :ckpt.action_dim]), ref["actions"], "un-normalised actions")


@torch.no_grad()
def test_the_flow_matching_loss_equals_lerobots(case):
    name, ckpt, model, ref = case
    images, masks, tokens, token_masks, state = _inputs(ckpt, model, ref)
    actions = ckpt.action.normalize(torch.from_numpy(ref["train_actions"]))
    _close(actions, ref["train_actions_norm"], "normalised actions")
    prefix = model.prefix(images, masks, tokens, token_masks)
    padded_state = None if ckpt.size.pi05 else pad_to(state, ckpt.size.max_state_dim)
    loss = model.flow_loss(prefix, padded_state, pad_to(actions, ckpt.size.max_action_dim),
                           torch.from_numpy(ref["train_noise"]), torch.from_numpy(ref["train_time"]))
    _close(loss, ref["train_loss"], "per-element loss")


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_the_3b_network_has_every_tensor_of_the_public_layout(kind):
    """Built on the meta device (no memory): our names and shapes are lerobot's 3B checkpoint's
    (assets/reference/<kind>_3b_layout.json, dumped from lerobot's own model), less the two unused
    ``lm_head`` s; about 3.2B / 3.4B parameters."""
    import json

    from policies.pi0.checkpoint import our_names
    from policies.pi0.model import PiSize

    public = json.loads((ASSETS / f"{kind}_3b_layout.json").read_text())
    expected = {name: tuple(t.shape) for name, t in
                our_names({k: torch.empty(shape, device="meta") for k, shape in public.items()}).items()}
    with torch.device("meta"):
        model = PiZero(PiSize(pi05=kind == "pi05"))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected
    assert sum(torch.Size(s).numel() for s in shapes.values()) == pytest.approx(3.23e9 if kind == "pi0" else 3.35e9,
                                                                                 rel=0.01)


@pytest.mark.parametrize("name", ["pi0_tiny_1cam", "pi05_tiny_1cam"])
@torch.no_grad()
def test_bfloat16_runs_as_lerobots_mixed_precision(name):
    """lerobot's ``dtype: bfloat16`` (the public checkpoints'): exactly, the same parameters in bfloat16 and in
    float32 and the same bfloat16 rotary frequencies (left in float32 they move keys and velocity by <= 3 bf16 ulps);
    from lerobot's prefix embeddings (our float32 SigLIP differs from theirs in the last bit, which rounding to
    bfloat16 can turn into a whole bfloat16 step) the same keys and values and every Euler step's velocity, up to
    the bfloat16 roundings another CPU may make differently (BF16_EPS), and that velocity as near our float32's."""
    ckpt = read_checkpoint(ASSETS / name, vision_head_dim=FIXTURES[name])
    model = PiZero(ckpt.size).eval()
    model.load_state_dict(ckpt.tensors(), strict=True)
    fp32 = PiZero(ckpt.size).eval()
    fp32.load_state_dict(model.state_dict(), strict=True)
    model.use_bfloat16()
    ref, ref32 = dict(np.load(ASSETS / f"{name}_bf16_outputs.npz")), dict(np.load(ASSETS / f"{name}_outputs.npz"))
    dtypes = json.loads(str(ref["dtypes_json"]))
    theirs = dtypes["state_dict_by_dtype"]
    ours = {}
    for n, p in model.named_parameters():
        ours.setdefault(str(p.dtype).removeprefix("torch."), set()).add(n)
    assert {k: set(our_names(dict.fromkeys(v))) for k, v in theirs.items()} == ours
    buffers = dict(model.named_buffers())
    for n, buffer in dtypes["float_buffers"].items():  # float32 frequencies rounded to bf16: equal on any CPU
        if n.endswith("rotary_emb.inv_freq"):
            freqs = buffers[n.removeprefix("model.").replace("rotary_emb.", "")]
            assert (str(freqs.dtype), freqs.tolist()) == ("torch." + buffer["dtype"], buffer["values"]), n
    images, masks, tokens, token_masks, state = _inputs(ckpt, model, ref32)
    _, pad = model.embed_prefix(images, masks, tokens, token_masks)
    embs = torch.from_numpy(ref["prefix_embs"]).to(torch.bfloat16)
    mask = additive(attention_mask_2d(pad, torch.zeros_like(pad, dtype=torch.long)))
    kv, hidden = model.vlm.model.language_model.cache(embs, torch.cumsum(pad, 1) - 1, mask)
    prefix = Prefix(kv, pad, hidden)
    kv32, hidden32 = fp32.vlm.model.language_model.cache(embs.float(), torch.cumsum(pad, 1) - 1, mask)
    prefix32 = Prefix(kv32, pad, hidden32)
    vlm_depth, expert_depth = ckpt.size.vlm.depth, ckpt.size.expert.depth
    for layer, tag in ((0, "layer0"), (vlm_depth - 1, "last")):
        assert prefix.kv[layer][0].dtype == torch.bfloat16
        roundings = KV_ROUNDINGS + STREAM_ROUNDINGS * layer
        _close_bf16(prefix.kv[layer][0].float(), ref[f"prefix_k_{tag}"], roundings, f"bfloat16 prefix keys, {tag}")
        _close_bf16(prefix.kv[layer][1].float(), ref[f"prefix_v_{tag}"], roundings, f"bfloat16 prefix values, {tag}")
    padded_state = None if ckpt.size.pi05 else pad_to(state, ckpt.size.max_state_dim)
    x = torch.from_numpy(ref32["noise"])
    roundings = STREAM_ROUNDINGS * (vlm_depth + expert_depth) + 1  # the expert reads every VLM layer's keys
    for k in range(int(ckpt.config["num_inference_steps"])):
        t = torch.from_numpy(ref["step_t"][k])
        v = model.velocity(prefix, padded_state, x, t)
        assert v.dtype == torch.float32
        _close_bf16(v, ref["step_v"][k], roundings, f"bfloat16 velocity at step {k}")
        _close_bf16(v, fp32.velocity(prefix32, padded_state, x, t), roundings, f"bfloat16 against float32, step {k}")
        x = torch.from_numpy(ref["step_x_out"][k])


# -- openpi's own PyTorch model (benchmarks/reference/make_openpi_fixtures.sh) -----------------------------------
@pytest.mark.parametrize("name", ["openpi_pi0_tiny", "openpi_pi05_tiny"])
@torch.no_grad()
def test_an_openpi_checkpoint_computes_what_openpis_model_does(name):
    """A tiny checkpoint openpi's PI0Pytorch built and ran, read in openpi's layout: our images, normalised state
    (openpi's eps), prefix embeddings and pad masks (the right wrist slot masked), every Euler step's velocity
    from openpi's own inputs, and the chunk at the times openpi's sampler visits (float32 ``t += dt``; on the
    exact grid the chunk drifts by ~5e-5) equal openpi's."""
    ckpt = read_checkpoint(ASSETS / name, vision_head_dim=16)
    assert ckpt.layout == "openpi" and ckpt.size.pi05 == (name == "openpi_pi05_tiny")
    model = PiZero(ckpt.size).eval()
    model.load_state_dict(ckpt.tensors(), strict=True)
    ref = dict(np.load(ASSETS / f"{name}_outputs.npz"))
    frames = torch.from_numpy(ref["frames_u8"]).permute(0, 1, 4, 2, 3).float() / 255
    images = [vision_input(f, 224) for f in frames]
    _close(torch.stack(images), ref["images"], "images")
    state = pad_to(ckpt.state.normalize(torch.from_numpy(ref["state_raw"])), 32)
    _close(state, ref["state"], "normalised state")
    masks = [torch.from_numpy(m) for m in ref["image_masks"]]
    tokens, token_masks = torch.from_numpy(ref["tokens"]), torch.from_numpy(ref["token_mask"])
    embs, pad = model.embed_prefix(images, masks, tokens, token_masks)
    _close(embs, ref["prefix_embs"], "prefix embeddings")
    assert torch.equal(pad, torch.from_numpy(ref["prefix_pad_masks"]))
    prefix = model.prefix(images, masks, tokens, token_masks)
    padded_state = None if ckpt.size.pi05 else state
    for k in range(len(ref["step_t"])):
        v = model.velocity(prefix, padded_state, torch.from_numpy(ref["step_x"][k]), torch.from_numpy(ref["step_t"][k]))
        _close(v, ref["step_v"][k], f"velocity at step {k}")
    chunk = model.sample(prefix, padded_state, torch.from_numpy(ref["noise"]), 10, times=accumulated_time_grid(10))
    _close(chunk, ref["actions"], "action chunk")
    assert (model.sample(prefix, padded_state, torch.from_numpy(ref["noise"]), 10) - chunk).abs().max() > 1e-5
