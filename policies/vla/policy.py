"""An OpenVLA policy behind the Policy protocol: action tokens sampled autoregressively, a value
head on the last prompt token's hidden state, PPO / GRPO log-probs over action tokens.

``act(obs)`` -> ``(bins [B, A] as float, log_prob [B], value [B])``: the policy's "actions"
are the sampled bins (what is scored); :meth:`to_env` decodes them into the env's
continuous actions. Observations: ``rgb`` uint8 ``[B, H, W, 3]`` and, where the env has
one, ``instruction`` uint8 ``[B, 128]`` (else ``policy.instruction``).

Sampling uses the caller's standard-normal ``noise [B, A]``: token ``j`` is the inverse
CDF of the (temperature-scaled, action-masked) distribution at ``Phi(noise[:, j])``, so
rollouts are as reproducible as a Gaussian policy's.
"""

from __future__ import annotations

import torch
from torch import nn

from policies.registry import POLICIES
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer
from policies.vla.openvla import PROMPT, OpenVLAForActionPrediction, tiny_config
from policies.vla.processor import byte_tokenizer, pixel_values, tokenize_prompts

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _instructions(obs: dict[str, torch.Tensor], fallback: str) -> list[str]:
    if "instruction" not in obs:
        return [fallback] * obs["rgb"].shape[0]
    from envs.libero import decode_instruction

    return [decode_instruction(row) for row in obs["instruction"].cpu()]


@POLICIES.register("openvla")
class OpenVLAPolicy(nn.Module):
    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        if "rgb" not in obs_spec:
            from embodied.errors import UserError

            raise UserError("policy=openvla needs camera images: use an env with obs_mode: rgb.")
        if cfg.model_path:
            from transformers import AutoTokenizer

            self.model = OpenVLAForActionPrediction.from_pretrained(cfg.model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        else:
            self.tokenizer = byte_tokenizer()
            self.model = OpenVLAForActionPrediction(tiny_config(len(self.tokenizer), cfg.image_size))
        self.action_dim, self.temperature, self.instruction = action_dim, cfg.temperature, cfg.instruction
        self.image_size = self.model.config.image_sizes[0]
        self.actions = ActionTokenizer(ActionStats.identity(action_dim), vocab_size=len(self.tokenizer))
        hidden = self.model.config.text_config.hidden_size
        self.value_head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        if cfg.lora_rank:
            self._add_lora(cfg.lora_rank)

    def _add_lora(self, rank: int) -> None:
        """LoRA adapters in the language model; only they and the value head train."""
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS),
                                self.model.language_model)
        for name, param in self.named_parameters():
            param.requires_grad = "lora_" in name or name.startswith("value_head")

    # -- inputs ------------------------------------------------------------------------
    def _prompt_inputs(self, obs: dict[str, torch.Tensor], action_ids: torch.Tensor | None = None):
        """Embeddings, attention mask and positions of ``[BOS] + patches + prompt (+ action_ids)``."""
        prompts = [PROMPT.format(instruction=text.lower()) for text in _instructions(obs, self.instruction)]
        ids, mask = tokenize_prompts(self.tokenizer, prompts)
        device = self.value_head[0].weight.device
        ids, mask = ids.to(device), mask.to(device)
        if action_ids is not None:
            ids = torch.cat([ids, action_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(action_ids)], dim=1)
        pixels = pixel_values(obs["rgb"].to(device), self.image_size)
        embeds, mask = self.model.multimodal_embeddings(ids, pixels, mask)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: every row counts from its BOS
        return embeds, mask, positions

    def _bin_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> log-probs over the action bins ``[..., n_bins]`` (masked, tempered)."""
        return torch.log_softmax(logits[..., self.actions.action_ids.to(logits.device)] / self.temperature, dim=-1)

    # -- the Policy protocol ---------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        embeds, mask, positions = self._prompt_inputs(obs)
        lm = self.model.language_model
        out = lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                 output_hidden_states=True)
        value = self.value_head(out.hidden_states[-1][:, -1]).squeeze(-1)
        if noise is None:
            noise = torch.randn(embeds.shape[0], self.action_dim)
        uniform = torch.special.ndtr(noise.to(embeds.device))
        bins, logprob, logits, cache = [], 0.0, out.logits[:, -1], out.cache
        for j in range(self.action_dim):
            logp = self._bin_logprobs(logits)
            if deterministic:
                b = logp.argmax(-1)
            else:  # inverse CDF at u: the first bin whose cumulative probability exceeds u
                cdf = logp.exp().cumsum(-1)
                b = torch.searchsorted(cdf, (uniform[:, j] * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                b = b.clamp(max=self.actions.n_bins - 1)
            bins.append(b)
            logprob = logprob + logp.gather(-1, b[:, None]).squeeze(-1)
            if j + 1 < self.action_dim:
                token = self.actions.action_ids.to(b.device)[b][:, None]
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                positions = positions[:, -1:] + 1
                out = lm(inputs_embeds=lm.get_input_embeddings()(token), attention_mask=mask,
                         position_ids=positions, cache=cache, use_cache=True)
                logits, cache = out.logits[:, -1], out.cache
        return torch.stack(bins, dim=1).float(), logprob, value

    def bin_distributions(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Teacher-forced log-probs of every bin at every action token ``[B, A, n_bins]``, and the value."""
        action_ids = self.actions.action_ids.to(actions.device)[actions.long()]
        embeds, mask, positions = self._prompt_inputs(obs, action_ids[:, :-1])
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                        output_hidden_states=True)
        # the last prompt token predicts action token 0, action token j predicts j + 1
        value = self.value_head(out.hidden_states[-1][:, -self.action_dim]).squeeze(-1)
        return self._bin_logprobs(out.logits[:, -self.action_dim:]), value

    def token_logprobs(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """``(log-probs [B, A], entropies [B, A], value [B])`` of the bins ``actions``, token by token."""
        logp, value = self.bin_distributions(obs, actions)
        token_logp = logp.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return token_logp, -(logp.exp() * logp).sum(-1), value

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Action-level log-prob (the sum over its tokens), entropy and value, as PPO needs."""
        token_logp, entropy, value = self.token_logprobs(obs, actions)
        return token_logp.sum(-1), entropy.sum(-1), value

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        embeds, mask, positions = self._prompt_inputs(obs)
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                        output_hidden_states=True)
        return self.value_head(out.hidden_states[-1][:, -1]).squeeze(-1)

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        """Sampled bins ``[B, A]`` -> continuous env actions (bin centres, un-normalised)."""
        return self.actions.decode(self.actions.action_ids.to(actions.device)[actions.long()])
