"""Generation backends of token VLAs: the weights vLLM gets (CPU), its errors, and vLLM itself (GPU)."""

import pytest
import torch

from embodied.config import compose
from envs.common import UserError
from policies.registry import make_policy
from policies.vla.vllm_backend import merged_weights

SPEC = {"rgb": ((64, 64, 3), torch.uint8), "state": ((9,), torch.float32)}


def _qwen(*overrides: str, seed: int = 0):
    cfg = compose(["policy=qwen_vl_tiny", "policy.vla.instruction=push the cube", *overrides]).policy
    torch.manual_seed(seed)
    return make_policy(cfg, SPEC, 4).eval()


def _obs(batch: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"rgb": torch.randint(0, 256, (batch, 64, 64, 3), generator=g, dtype=torch.uint8)}


def test_merged_lora_weights_load_into_a_plain_model_with_the_same_outputs():
    """What vLLM is sent after a LoRA update: checkpoint names, adapters folded into the weights."""
    lora = _qwen("policy.vla.lora_rank=4")
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters matter
            torch.nn.init.normal_(param, std=0.05)
    plain = _qwen(seed=1)
    named = dict(merged_weights(lora.model))
    assert not any("lora_" in n or "base_layer" in n for n in named)
    assert set(named) == set(plain.model.state_dict())
    plain.model.load_state_dict(named)
    plain.value_head.load_state_dict(lora.value_head.state_dict())
    obs = _obs()
    bins = lora.act(obs, deterministic=True)[0]
    torch.testing.assert_close(plain.bin_distributions(obs, bins)[0], lora.bin_distributions(obs, bins)[0],
                               atol=1e-5, rtol=0)


def test_vllm_backend_errors_are_clear(tmp_path):
    with pytest.raises(UserError, match="generation backend"):
        _qwen("policy.vla.backend=tensorrt")
    with pytest.raises(UserError, match="model directory"):  # vLLM loads a saved model
        _qwen("policy.vla.backend=vllm").act(_obs())
    if not torch.cuda.is_available():
        _qwen().save_pretrained(tmp_path)
        with pytest.raises(UserError, match="CUDA GPU"):
            _qwen(f"policy.vla.model_path={tmp_path}", "policy.vla.backend=vllm").act(_obs())


@pytest.mark.gpu
def test_vllm_generates_action_tokens_scored_like_the_hf_model(tmp_path):
    """A saved tiny Qwen-VL VLA on vLLM: only action tokens, log-probs and values from the HF model,
    greedy tokens as the HF model's, and a weight sync reaches the engine."""
    hf = _qwen()
    hf.save_pretrained(tmp_path)
    policy = _qwen(f"policy.vla.model_path={tmp_path}", "policy.vla.backend=vllm").cuda()
    reference = _qwen(f"policy.vla.model_path={tmp_path}").cuda()
    obs = {k: v.cuda() for k, v in _obs(8).items()}
    bins, token_logp, value = policy.act(obs, deterministic=True)
    assert bins.shape == token_logp.shape == (8, 4) and bool(((bins >= 0) & (bins < 256)).all())
    hf_bins = reference.act(obs, deterministic=True)[0]
    assert (bins == hf_bins).float().mean() >= 0.9  # bf16 engine vs fp32 model: near-ties may flip
    scored = reference.token_logprobs(obs, bins)
    torch.testing.assert_close(token_logp, scored[0])
    torch.testing.assert_close(value, scored[2])
    sampled = policy.act(obs)[0]
    assert bool(((sampled >= 0) & (sampled < 256)).all())
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(-1.0)  # an update that changes every greedy choice
    policy.weights_updated()
    flipped = policy.act(obs, deterministic=True)[0]
    assert (flipped != bins).float().mean() > 0.5
