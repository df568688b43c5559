"""Observations -> VLA inputs: images resized and normalised per vision backbone, prompts tokenized.

Shapes: ``rgb`` uint8 ``[B, H, W, 3]`` -> ``pixel_values`` float ``[B, 3 * backbones, S, S]``
(DINOv2's ImageNet normalisation, then SigLIP's 0.5 / 0.5, as OpenVLA stacks them);
instructions -> left-padded ``input_ids [B, L]`` and ``attention_mask [B, L]`` starting
with BOS, so the last prompt token of every row sits in the last column.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# per-backbone (mean, std): DINOv2 uses ImageNet's statistics, SigLIP maps [0, 1] to [-1, 1]
NORMALIZATION = (((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))


def pixel_values(rgb: torch.Tensor, size: int, backbones: int = 2) -> torch.Tensor:
    """``rgb`` uint8 ``[B, H, W, 3]`` -> ``[B, 3 * backbones, size, size]`` (bilinear, antialiased)."""
    x = rgb.permute(0, 3, 1, 2).float() / 255.0
    if x.shape[-2:] != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)
    views = []
    for mean, std in NORMALIZATION[:backbones]:
        views.append((x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1))
    return torch.cat(views, dim=1)


def tokenize_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` ``[B, L]``, each row ``[BOS] + prompt``."""
    rows = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = torch.tensor(row)
        mask[i, length - len(row):] = 1
    return ids, mask


def byte_tokenizer(reserved: int = 256) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer for tiny VLAs: 256 byte tokens, BOS / EOS / PAD, then ``reserved``
    unused tokens at the end of the vocabulary, which OpenVLA-style models use as action tokens
    (they are never produced by text). Deterministic: nothing is trained or downloaded."""
    byte_vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_tokens([f"<unused_{i}>" for i in range(reserved)], special_tokens=True)
    return fast
