"""Continuous actions <-> discrete action tokens (the OpenVLA scheme).

Each action dimension is normalised to [-1, 1] with per-dataset statistics
(``low -> -1``, ``high -> +1``, clipped: q01 / q99 for OpenVLA, or min / max under OFT's
"bounds" normalisation; dimensions outside ``normalize_mask``, such as the gripper, are taken
as already in [-1, 1]), then cut into ``n_bins``
uniform bins. Bin ``b`` is the token ``action_ids[b]``:

- ``"last_ids"`` (OpenVLA): the last ``n_bins`` ids of the base vocabulary, in
  reverse, ``vocab_size - 1 - b``, so a real OpenVLA checkpoint decodes correctly;
- ``"added"`` (Qwen-VL VLA): ``n_bins`` tokens appended to the vocabulary,
  ``first_id + b``.

OpenVLA's exact arithmetic: bin edges ``linspace(-1, 1, n_bins)``, a value falls in
bin ``digitize(x, edges) - 1``; decoding returns the centre of that interval (the
top bin, which only exactly 1.0 reaches, decodes to the last centre). So a
round trip is within half a bin of the normalised action.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from envs.common import unknown_name_error

MODES = ("last_ids", "added")


@dataclass(frozen=True)
class ActionStats:
    """Per-dimension statistics of a dataset's actions (or proprio), ``[A]`` each: the values that map
    to -1 and +1 (q01 / q99, or min / max: policies/vla/checkpoint.py ``NORMALIZATIONS``)."""

    low: torch.Tensor
    high: torch.Tensor
    normalize_mask: torch.Tensor  # bool: which dimensions low / high rescale

    @classmethod
    def identity(cls, action_dim: int) -> ActionStats:
        """Actions already in [-1, 1] (simulators with a normalised action box)."""
        return cls(-torch.ones(action_dim), torch.ones(action_dim), torch.zeros(action_dim, dtype=torch.bool))

    @classmethod
    def from_actions(cls, actions: torch.Tensor, normalize_mask: torch.Tensor | None = None) -> ActionStats:
        """Quantiles of a dataset's actions ``[N, A]``. Every dimension is normalised by default,
        except those whose q01 and q99 coincide (e.g. a gripper command the demos never change):
        rescaling them would divide by zero, so they stay as they are."""
        q = torch.quantile(actions.double(), torch.tensor([0.01, 0.99], dtype=torch.float64), dim=0).float()
        mask = torch.ones(actions.shape[-1], dtype=torch.bool) if normalize_mask is None else normalize_mask
        return cls(q[0], q[1], mask & (q[1] - q[0] > 1e-6))

    def as_tensor(self) -> torch.Tensor:
        """``[3, A]``: low, high and the mask (as 0 / 1), the layout a policy keeps in its state dict."""
        return torch.stack([self.low.float(), self.high.float(), self.normalize_mask.float()])

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> ActionStats:
        return cls(packed[0], packed[1], packed[2] > 0.5)

    def to_dict(self, keys: tuple[str, str] = ("q01", "q99")) -> dict:
        """A ``dataset_statistics.json`` block, low / high under ``keys`` (the normalisation's fields)."""
        return {keys[0]: self.low.tolist(), keys[1]: self.high.tolist(), "mask": self.normalize_mask.tolist()}

    @classmethod
    def from_dict(cls, data: dict, keys: tuple[str, str] = ("q01", "q99")) -> ActionStats:
        return cls(torch.tensor(data[keys[0]]), torch.tensor(data[keys[1]]), torch.tensor(data["mask"]))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[-1, 1]``: rescaled where the mask says, as it is elsewhere, then clipped
        (OpenVLA-OFT's ``normalize_proprio``; the action tokenizer's normalisation)."""
        low, high = self.low.to(x.device, x.dtype), self.high.to(x.device, x.dtype)
        scaled = 2 * (x - low) / (high - low + 1e-8) - 1
        return torch.where(self.normalize_mask.to(x.device), scaled, x).clamp(-1.0, 1.0)


class ActionTokenizer:
    """Maps actions ``[..., A]`` to token ids ``[..., A]`` and back; masks logits to action ids."""

    def __init__(self, stats: ActionStats, n_bins: int = 256, mode: str = "last_ids",
                 vocab_size: int | None = None, first_id: int | None = None):
        if mode not in MODES:
            raise unknown_name_error("action token mode", mode, list(MODES))
        if mode == "last_ids":
            self.action_ids = vocab_size - 1 - torch.arange(n_bins)
        else:
            self.action_ids = first_id + torch.arange(n_bins)
        self.stats, self.n_bins, self.mode = stats, n_bins, mode
        edges = torch.linspace(-1.0, 1.0, n_bins, dtype=torch.float64)
        self.edges = edges
        self.centers = ((edges[:-1] + edges[1:]) / 2).float()  # n_bins - 1 interval centres
        self.bin_width = 2.0 / (n_bins - 1)
        # id -> bin (-1 for ids that are not action tokens), over every id up to the largest
        self._bin_of_id = torch.full((int(self.action_ids.max()) + 1,), -1, dtype=torch.long)
        self._bin_of_id[self.action_ids] = torch.arange(n_bins)

    # -- normalisation -----------------------------------------------------------------
    def normalize(self, actions: torch.Tensor) -> torch.Tensor:
        return self.stats.normalize(actions)

    def unnormalize(self, normalized: torch.Tensor) -> torch.Tensor:
        s = self.stats
        scaled = 0.5 * (normalized + 1) * (s.high - s.low + 1e-8) + s.low
        return torch.where(s.normalize_mask, scaled, normalized)

    # -- tokens ------------------------------------------------------------------------
    def bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions ``[..., A]`` (environment units) -> bin indices ``[..., A]`` in [0, n_bins)."""
        x = self.normalize(actions.float()).double()
        return (torch.bucketize(x, self.edges, right=True) - 1).clamp(0, self.n_bins - 1)

    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions ``[..., A]`` -> token ids ``[..., A]``."""
        return self.action_ids[self.bins(actions)]

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[..., A]`` -> actions ``[..., A]``; ids that are not action tokens are an error."""
        bins = self.bins_of(token_ids)
        if bool((bins < 0).any()):
            raise ValueError("decode() got ids that are not action tokens; sample with mask_logits()")
        return self.unnormalize(self.bin_values(bins))

    def bin_values(self, bins: torch.Tensor | None = None) -> torch.Tensor:
        """The normalised action each bin decodes to, ``[...]`` for ``bins [...]`` (all ``n_bins``
        if None): its interval's centre; the top bin, reached only by exactly 1.0, the one below's."""
        bins = torch.arange(self.n_bins) if bins is None else bins
        return self.centers[bins.clamp(max=self.n_bins - 2)]

    def bins_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> bin indices (-1 where an id is not an action token)."""
        ids = token_ids.long()
        inside = (ids >= 0) & (ids < self._bin_of_id.numel())
        return torch.where(inside, self._bin_of_id[ids.clamp(0, self._bin_of_id.numel() - 1)], -1)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits with every non-action id set to -inf (sampling can only pick actions)."""
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[self.action_ids.to(logits.device)] = True
        return logits.masked_fill(~keep, float("-inf"))
