"""Action tokenizer: OpenVLA's binning, a round trip within half a bin, logits masked to action ids."""

import numpy as np
import pytest
import torch

from policies.vla.action_tokenizer import ActionStats, ActionTokenizer

VOCAB = 32000


def _stats(seed: int) -> ActionStats:
    g = torch.Generator().manual_seed(seed)
    q01 = -torch.rand(7, generator=g) * 3
    q99 = torch.rand(7, generator=g) * 3 + 0.1
    mask = torch.tensor([True] * 6 + [False])  # the gripper is not rescaled (OpenVLA's mask)
    return ActionStats(q01, q99, mask)


@pytest.mark.parametrize("mode", ["last_ids", "added"])
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_within_half_a_bin(mode, seed):
    stats = _stats(seed)
    tok = ActionTokenizer(stats, mode=mode, vocab_size=VOCAB, first_id=VOCAB)
    g = torch.Generator().manual_seed(100 + seed)
    normalized = torch.rand(5000, 7, generator=g) * 2 - 1
    normalized[:4] = torch.tensor([-1.0, 1.0, 0.0, 1e-9])[:, None]  # the edges and the middle
    actions = tok.unnormalize(normalized)
    back = tok.decode(tok.encode(actions))
    error = (tok.normalize(back) - normalized).abs()
    assert float(error.max()) <= tok.bin_width / 2 + 1e-6
    # in environment units the error scales with each dimension's range
    half_bin = tok.bin_width / 2 * torch.where(stats.normalize_mask, (stats.high - stats.low) / 2, torch.ones(7))
    assert bool(((back - actions).abs() <= half_bin + 1e-5).all())


def test_last_ids_follow_openvla():
    """OpenVLA: token = vocab_size - digitize(a, linspace(-1, 1, 256)); decode to bin centres."""
    tok = ActionTokenizer(ActionStats.identity(7), vocab_size=VOCAB)
    actions = torch.rand(200, 7, generator=torch.Generator().manual_seed(0)) * 2.2 - 1.1  # some out of range
    edges = np.linspace(-1, 1, 256)
    expected = VOCAB - np.digitize(np.clip(actions.numpy(), -1, 1), edges)
    assert (tok.encode(actions).numpy() == expected).all()
    centers = (edges[:-1] + edges[1:]) / 2
    ids = torch.tensor(expected)
    expected_actions = centers[np.clip(VOCAB - expected - 1, 0, 254)]
    np.testing.assert_allclose(tok.decode(ids).numpy(), expected_actions, rtol=0, atol=1e-6)
    assert set(tok.action_ids.tolist()) == set(range(VOCAB - 256, VOCAB))


def test_added_tokens_are_consecutive_after_the_vocabulary():
    tok = ActionTokenizer(ActionStats.identity(3), mode="added", first_id=151_665)
    assert tok.action_ids.tolist() == list(range(151_665, 151_665 + 256))
    assert tok.encode(torch.tensor([[-1.0, 0.0, 1.0]])).tolist() == [[151_665, 151_665 + 127, 151_665 + 255]]


def test_masked_logits_only_sample_action_ids():
    tok = ActionTokenizer(ActionStats.identity(7), vocab_size=VOCAB)
    logits = torch.randn(4, 7, VOCAB + 64)  # models pad their vocabulary (OpenVLA: 32064)
    logits[..., 5] = 1e4  # a text token the unmasked model would always pick
    masked = tok.mask_logits(logits)
    assert torch.isinf(masked[..., :VOCAB - 256]).all() and torch.isinf(masked[..., VOCAB:]).all()
    sampled = torch.distributions.Categorical(logits=masked).sample()
    assert bool((tok.bins_of(sampled) >= 0).all())
    tok.decode(sampled)  # every sample decodes


def test_decoding_a_text_token_is_an_error():
    tok = ActionTokenizer(ActionStats.identity(2), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="not action tokens"):
        tok.decode(torch.tensor([[5, VOCAB - 1]]))


def test_stats_from_a_dataset_and_back():
    actions = torch.randn(1000, 4, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 2.0, 3.0, 4.0])
    stats = ActionStats.from_actions(actions)
    assert bool((stats.low < 0).all() and (stats.high > 0).all())
    assert (ActionStats.from_dict(stats.to_dict()).high == stats.high).all()
    tok = ActionTokenizer(stats, vocab_size=VOCAB)
    inside = tok.normalize(actions).abs() < 1  # 98% of the data lies strictly inside [-1, 1]
    assert 0.9 < float(inside.all(dim=-1).float().mean()) < 1.0


def test_a_dimension_the_dataset_never_changes_is_left_unnormalised():
    """A constant gripper command has q01 == q99: rescaling it would divide by zero."""
    actions = torch.cat([torch.linspace(-0.2, 0.2, 101)[:, None], torch.ones(101, 1)], dim=1)
    stats = ActionStats.from_actions(actions)
    assert stats.normalize_mask.tolist() == [True, False]
    tok = ActionTokenizer(stats, vocab_size=VOCAB)
    assert torch.allclose(tok.decode(tok.encode(actions))[:, 1], torch.ones(101), atol=tok.bin_width)
    assert (ActionStats.from_tensor(stats.as_tensor()).normalize_mask == stats.normalize_mask).all()
