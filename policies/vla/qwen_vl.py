"""A Qwen2.5-VL based VLA: transformers' Qwen2.5-VL with 256 action tokens added to the vocabulary.

Prompt: ``<|vision_start|><|image_pad|> x N<|vision_end|>What action should the robot take to
{instruction}?`` (``N`` image tokens: the image processor's patch grid merged 2 x 2), then one
action token per action dimension. ``policy.vla.model_path`` loads a saved Qwen2.5-VL directory
(model + tokenizer + preprocessor_config.json, whose image processing is used; action tokens are
added when missing); without it a tiny model is built.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)
from transformers.image_utils import SizeDict

from policies.base import POLICIES, require_model_dir
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer
from policies.vla.checkpoint import (
    action_bounds,
    check_model_files,
    check_pretrained_weights,
    checkpoint_action_stats,
    dataset_statistics,
    read_pretrained_config,
)
from policies.vla.policy import (
    TINY_IMAGE_SIZE,
    DecodeState,
    TokenVLAPolicy,
    instructions_of,
    require_images,
)
from policies.vla.processor import PREPROCESSOR_FILE, byte_tokenizer, tokenize_prompts

QWEN_PROMPT = "What action should the robot take to {instruction}?"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
N_BINS = 256


def action_token(b: int) -> str:
    return f"<|action_{b}|>"


def tiny_qwen_config(tokenizer, image_size: int = 56, hidden: int = 128) -> Qwen2_5_VLConfig:
    """A ~1M-parameter Qwen2.5-VL (2 vision blocks, 2 decoder layers) for CPU runs and tests."""
    start, pad, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": hidden,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "fullatt_block_indexes": [1],
              "window_size": 56}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad, vision_start_token_id=start,
                            vision_end_token_id=end)


def qwen_image_processor(model_dir: str | None, image_size: int) -> Qwen2VLImageProcessorPil:
    """Qwen2.5-VL's image processor as ``model_dir``'s preprocessor_config.json sets it up (pixel
    range, patch / merge / temporal patch size, resample, rescale, mean / std), its pixel count
    capped at ``policy.vla.image_size ** 2``; transformers' defaults (min 56 x 56 pixels) without one.
    Images are resized to multiples of ``patch_size * merge_size`` (28) px within the pixel range:
    a 64 px cap turns 96 px frames into 56 px, 2 x 2 image tokens."""
    path = Path(model_dir) / PREPROCESSOR_FILE if model_dir else None
    if path is None or not path.exists():
        return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": image_size ** 2})
    images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    images.size = SizeDict(shortest_edge=images.size.shortest_edge,
                           longest_edge=min(images.size.longest_edge, image_size ** 2))
    return images


def read_qwen_config(model_dir: str) -> Qwen2_5_VLConfig:
    """``model_dir``'s config.json as the Qwen2.5-VL config ``from_pretrained`` builds the model from,
    its dtype and activation fields checked (:func:`read_pretrained_config`); no weights are read."""
    return read_pretrained_config(Qwen2_5_VLConfig, model_dir, "a Qwen2.5-VL")


def tiny_tokenizer():
    tokenizer = byte_tokenizer(reserved=0)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    return tokenizer


@POLICIES.register("qwen_vl")
class QwenVLPolicy(TokenVLAPolicy):
    """Qwen2.5-VL with added action tokens ``<|action_0|> .. <|action_255|>``."""

    hub_id = "Qwen/Qwen2.5-VL-3B-Instruct"
    # what a checkpoint directory loads into, and what check_config builds on the meta device
    model_class = Qwen2_5_VLForConditionalGeneration

    @classmethod
    def resolve_settings(cls, cfg) -> None:
        """``policy.vla.image_size`` left null: 64 (its checkpoints record pixel bounds, not a size: the image
        processor's longest edge is capped at its square)."""
        super().resolve_settings(cfg)
        if cfg.vla.image_size is None:
            cfg.vla.image_size = TINY_IMAGE_SIZE

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        require_images(obs_spec, "qwen_vl")
        if cfg.vla.model_path:
            from transformers import AutoTokenizer

            require_model_dir(cfg.vla.model_path, self.hub_id)
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.vla.model_path)
            config = read_qwen_config(cfg.vla.model_path)  # what check_config built on the meta device
            self.model = self.model_class.from_pretrained(cfg.vla.model_path, config=config)
        else:
            self.tokenizer = tiny_tokenizer()
            self.model = None
        if action_token(0) not in self.tokenizer.get_vocab():
            self.tokenizer.add_tokens([action_token(b) for b in range(N_BINS)], special_tokens=True)
        if self.model is None:
            self.model = Qwen2_5_VLForConditionalGeneration(tiny_qwen_config(self.tokenizer, cfg.vla.image_size))
        if self.model.get_input_embeddings().weight.shape[0] < len(self.tokenizer):
            self.model.resize_token_embeddings(len(self.tokenizer))
        first = self.tokenizer.convert_tokens_to_ids(action_token(0))
        stats = (checkpoint_action_stats(cfg.vla.model_path, getattr(self.model.config, "norm_stats", None),
                                         cfg.vla.unnorm_key, action_dim, cfg.vla.normalization)
                 if cfg.vla.model_path else ActionStats.identity(action_dim))
        actions = ActionTokenizer(stats, mode="added", first_id=first)
        self._setup_rl(cfg, action_dim, actions, self.model.config.text_config.hidden_size,
                       self.model.model.language_model)
        self.image_size = cfg.vla.image_size
        self.images = qwen_image_processor(cfg.vla.model_path, cfg.vla.image_size)

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        """Before any worker starts, for ``policy.vla.model_path``: its files, config.json (dtype and
        activation fields, transformers' own validation), its weights against the model that config builds
        (on the meta device: :func:`check_pretrained_weights`) and its action statistics."""
        path = cfg.vla.model_path
        if not path:
            return []
        check_model_files(path, needs_processor=False)  # without one, transformers' default image processing
        config = read_qwen_config(path)
        check_pretrained_weights(path, lambda: cls.model_class(config))
        found = dataset_statistics(path, getattr(config, "norm_stats", None), cfg.vla.unnorm_key)
        action_bounds(found, path, action_dim, cfg.vla.normalization)
        return []

    def _qwen_prompts(self, obs, image_tokens: int) -> list[str]:
        start, pad, end = VISION_TOKENS
        return [start + pad * image_tokens + end + QWEN_PROMPT.format(instruction=text)
                for text in instructions_of(obs, self.instruction)]

    def vllm_prompts(self, obs) -> list[str]:
        """The prompts for vLLM, which expands the one image pad into the image's tokens itself."""
        return self._qwen_prompts(obs, image_tokens=1)

    def _run(self, obs, action_ids=None, use_cache=False):
        device = self.value_head[0].weight.device
        vision = self.images(images=list(obs["rgb"].cpu().numpy()), return_tensors="pt")
        grid = vision["image_grid_thw"]
        image_tokens = int(grid[0].prod()) // self.images.merge_size ** 2
        ids, mask = tokenize_prompts(self.tokenizer, self._qwen_prompts(obs, image_tokens))
        ids, mask = ids.to(device), mask.to(device)
        if action_ids is not None:
            ids = torch.cat([ids, action_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(action_ids)], dim=1)
        token_types = (ids == self.model.config.image_token_id).int()  # 1 marks image tokens
        out = self.model(input_ids=ids, attention_mask=mask, pixel_values=vision["pixel_values"].to(device),
                         image_grid_thw=grid.to(device), mm_token_type_ids=token_types, use_cache=use_cache,
                         output_hidden_states=True)
        return out.logits, out.hidden_states[-1], DecodeState(out.cache, mask)

    def _step(self, token, state):
        mask = torch.cat([state.mask, torch.ones_like(token)], dim=1)
        # the new token's 3-D rope position: its text position plus the prompt's offset (the image
        # tokens take fewer positions than tokens); transformers would build all of them here
        position = mask.long().cumsum(-1)[:, -1:] - 1 + self.model.model.rope_deltas
        out = self.model(input_ids=token, attention_mask=mask, cache=state.cache, use_cache=True,
                         position_ids=position.view(1, -1, 1).repeat(3, 1, 1))
        return out.logits[:, -1], DecodeState(out.cache, mask)
