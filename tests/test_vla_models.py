"""VLA models: OpenVLA's architecture and checkpoint layout, save_pretrained / offline reload."""

import os

import pytest
import torch
from transformers import LlamaConfig

from policies.vla.openvla import OpenVLAConfig, OpenVLAForActionPrediction, tiny_config


def test_full_size_openvla_has_the_checkpoint_layout():
    """Built on the meta device (no memory): every shape the public openvla-7b checkpoint has."""
    config = OpenVLAConfig(text_config=LlamaConfig(vocab_size=32064, pad_token_id=32000).to_dict())
    with torch.device("meta"):
        model = OpenVLAForActionPrediction(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {
        "vision_backbone.featurizer.cls_token": (1, 1, 1024),
        "vision_backbone.featurizer.reg_token": (1, 4, 1024),
        "vision_backbone.featurizer.pos_embed": (1, 256, 1024),  # patches only (no_embed_class)
        "vision_backbone.featurizer.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_backbone.featurizer.blocks.23.ls1.scale_factor": (1024,),
        "vision_backbone.featurizer.blocks.23.attn.qkv.weight": (3072, 1024),
        "vision_backbone.featurizer.norm.weight": (1024,),
        "vision_backbone.fused_featurizer.pos_embed": (1, 256, 1152),
        "vision_backbone.fused_featurizer.blocks.26.mlp.fc1.weight": (4304, 1152),
        "vision_backbone.fused_featurizer.attn_pool.latent": (1, 1, 1152),
        "vision_backbone.fused_featurizer.attn_pool.kv.weight": (2304, 1152),
        "projector.fc1.weight": (8704, 2176),
        "projector.fc2.weight": (4096, 8704),
        "projector.fc3.weight": (4096, 4096),
        "language_model.model.embed_tokens.weight": (32064, 4096),
        "language_model.lm_head.weight": (32064, 4096),
        "language_model.model.layers.31.self_attn.q_proj.weight": (4096, 4096),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert not any(k.endswith((".gamma", ".beta")) for k in shapes)  # HF would rename those on load
    assert not any("fused_featurizer" in k and ".ls1." in k for k in shapes)  # SigLIP has no LayerScale
    assert sum(torch.Size(s).numel() for s in shapes.values()) == pytest.approx(7.54e9, rel=0.01)


def test_features_come_from_the_second_to_last_block():
    model = OpenVLAForActionPrediction(tiny_config(vocab_size=512)).eval()
    vit = model.vision_backbone.featurizer
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        features = vit(images)
        vit.blocks[-1].mlp.fc2.weight.add_(1.0)  # the last block must not matter
        assert torch.equal(vit(images), features)
    assert features.shape == (2, 64, 64)  # the 5 prefix tokens (cls + 4 registers) dropped


def test_tiny_openvla_saves_and_reloads_offline_to_identical_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = OpenVLAForActionPrediction(tiny_config(vocab_size=512)).eval()
    assert sum(p.numel() for p in model.parameters()) < 30e6
    input_ids = torch.randint(0, 512, (2, 12))
    pixels = torch.randn(2, 6, 64, 64)
    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))
    reloaded = OpenVLAForActionPrediction.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixels).logits
        again = reloaded(input_ids=input_ids, pixel_values=pixels).logits
    assert logits.shape == (2, 1 + 64 + 11, 512)  # [BOS] + patches + the rest of the prompt
    assert torch.equal(logits, again)
