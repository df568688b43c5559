"""vLLM as the rollout generation backend of token VLAs (``policy.vla.backend: vllm``; GPU only).

vLLM samples the action tokens; the Hugging Face model then scores them in one teacher-forced
pass, which gives the token log-probs PPO / GRPO ratios are taken against (over the action
bins, tempered: exactly what the update recomputes) and the value. So the interface is the
``hf`` backend's: ``act(obs) -> (bins [B, T], token log-probs [B, T], value [B])``. vLLM draws
its own (seeded) randomness: rollouts do not follow the rollout worker's noise.

Only the Qwen2.5-VL VLA runs on vLLM (vLLM has no Prismatic/OpenVLA model), from its
``policy.vla.model_path`` directory. ``vllm`` is imported when the first rollout needs it; the
engine is built then, in the rollout worker only. After a weight sync the engine is reloaded
from the policy's weights (``load_weights`` in vLLM's worker, through ``collective_rpc``).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from envs.common import UserError

WORKER_EXTENSION = "policies.vla.vllm_backend.WeightLoader"


class WeightLoader:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``): replaces the model's weights."""

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.model.load_weights(weights=named)


def require_vllm():
    """The ``vllm`` module, or a UserError that says how to get a setup that has it."""
    if not torch.cuda.is_available():
        raise UserError("policy.vla.backend=vllm needs a CUDA GPU; this machine has none. Use policy.vla.backend=hf.")
    try:
        import vllm
    except ImportError:
        raise UserError("policy.vla.backend=vllm needs the vllm package: `pip install vllm` (it brings its own "
                        "CUDA build of torch), or use policy.vla.backend=hf.") from None
    return vllm


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s state dict under its checkpoint names, with every peft LoRA layer's adapter
    merged into its base weight (``W + scale * B @ A``) and the adapter tensors left out."""
    from peft.tuners.lora import LoraLayer

    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            merged[f"{name}.weight"] = base.weight + delta
    out = []
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        out.append((name, merged.get(name, tensor)))
    return out


class VLLMGenerator:
    """Action tokens for a :class:`policies.vla.qwen_vl.QwenVLPolicy` from a vLLM engine."""

    def __init__(self, policy, memory_fraction: float = 0.3, seed: int = 0):
        if type(policy).__name__ != "QwenVLPolicy" or not policy.model_path:
            raise UserError("policy.vla.backend=vllm runs the Qwen2.5-VL VLA from a model directory (policy=qwen_vl "
                            "with policy.vla.model_path); OpenVLA models have no vLLM implementation: use backend=hf.")
        vllm = require_vllm()
        self.vllm, self.policy = vllm, policy
        size = policy.images.size  # the HF path's processor (the checkpoint's, capped): same image tokens
        self.llm = vllm.LLM(model=policy.model_path, dtype="bfloat16", seed=seed, enforce_eager=True,
                            gpu_memory_utilization=memory_fraction, limit_mm_per_prompt={"image": 1},
                            mm_processor_kwargs={"min_pixels": size.shortest_edge, "max_pixels": size.longest_edge},
                            worker_extension_cls=WORKER_EXTENSION)
        self.stale = False

    def load_weights(self) -> None:
        """Copy the policy's weights, LoRA adapters merged in, into the engine (checkpoint names)."""
        named = [(name, tensor.to(torch.bfloat16).cpu()) for name, tensor in merged_weights(self.policy.model)]
        self.llm.collective_rpc("load_named_tensors", args=(named,))
        self.stale = False

    def generate(self, obs: dict[str, torch.Tensor], deterministic: bool) -> torch.Tensor:
        """Sampled (or greedy) action bins ``[B, T]``, restricted to the action tokens."""
        if self.stale:
            self.load_weights()
        policy, tokens = self.policy, self.policy.noise_dim
        params = self.vllm.SamplingParams(
            temperature=0.0 if deterministic else policy.temperature, max_tokens=tokens, min_tokens=tokens,
            allowed_token_ids=policy.actions.action_ids.tolist(), detokenize=False)
        prompts = [{"prompt": text, "multi_modal_data": {"image": Image.fromarray(np.asarray(image))}}
                   for text, image in zip(policy.vllm_prompts(obs), obs["rgb"].cpu(), strict=True)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        ids = torch.tensor([list(out.outputs[0].token_ids) for out in outputs])
        return policy.actions.bins_of(ids)
