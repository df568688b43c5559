"""Policies that emit one discrete action token per action dimension: what the VLAs
(``policies/vla/``) and the MLP token policy (``policies/mlp_tokens.py``) share.

``act(obs)`` -> ``(bins [B, T] as float, token log-probs [B, T], value [B])`` with ``T =
chunk_size * A`` tokens: ``policy.chunk_size`` actions of ``A`` dimensions, one token each. The
policy's "actions" are the sampled bins (what is scored); :meth:`TokenActionPolicy.to_env`
decodes them into the env's continuous actions, ``[B, A]`` or, for chunks, ``[B, chunk_size, A]``.
The PPO update sums token log-probs to the level it trains at (``algorithm.logprob_level``:
token, action, chunk; ``embodied/algorithms/logprob_levels.py``).

Sampling uses the caller's standard-normal ``noise [B, T]``: token ``j`` is the inverse CDF of
the (temperature-scaled, action-masked) distribution at ``Phi(noise[:, j])``, so rollouts are as
reproducible as a Gaussian policy's, whatever the batch split.

A subclass provides the trunk: :meth:`TokenActionPolicy.bin_distributions` (teacher-forced
distributions of every token) and ``act``; :class:`ParallelTokenPolicy` derives both from one
forward pass that scores all ``T`` tokens at once (OpenVLA-OFT, the MLP token policy).
"""

from __future__ import annotations

import torch

from policies.base import Policy
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer
from policies.vla.adapters import InputAdapter


class TokenActionPolicy(Policy):
    """Action tokens, their sampling from seeded noise, their log-probs and their decoding.

    A subclass calls :meth:`_setup_actions` in its ``__init__`` and implements
    :meth:`bin_distributions`, ``act`` and ``value``; its value head is ``self.value_head``.
    """

    chunks = True  # policy.chunk_size actions per decision
    token_actions = True
    demo_statistics = ("loss", "token_accuracy")
    forward_methods = (*Policy.forward_methods, "bin_distributions")
    critic_modules = ("value_head",)

    def _setup_actions(self, cfg, action_dim: int, actions: ActionTokenizer) -> None:
        """The action tokens and how they are sampled: ``policy.chunk_size``, ``temperature`` and
        the checkpoint family's action post-processing (``policy.vla.gripper``)."""
        self.action_dim, self._action_tokenizer = action_dim, actions
        # the q01 / q99 statistics travel with the weights (checkpoints, weight syncs): SFT sets them
        self.register_buffer("action_stats", actions.stats.as_tensor())
        self.chunk_size = cfg.chunk_size
        self.noise_dim = cfg.chunk_size * action_dim  # tokens per decision: T
        self.temperature = cfg.temperature
        self.adapter = InputAdapter.from_config(cfg)

    @property
    def actions(self) -> ActionTokenizer:
        """The action tokenizer, normalising with the statistics in ``action_stats`` as they are
        now (a checkpoint load or a weight sync replaces that buffer's data)."""
        self._action_tokenizer.stats = ActionStats.from_tensor(self.action_stats.cpu())
        return self._action_tokenizer

    def set_action_stats(self, stats: ActionStats) -> None:
        """Normalise actions with ``stats`` from now on (SFT: its demos' q01 / q99)."""
        self.action_stats.copy_(stats.as_tensor())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Checkpoints saved before ``action_stats`` existed normalised with [-1, 1]: they load so."""
        if "action_stats" not in state_dict:
            state_dict = {**state_dict, "action_stats": ActionStats.identity(self.action_dim).as_tensor()}
        return super().load_state_dict(state_dict, strict, assign)

    def _bin_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> log-probs over the action bins ``[..., n_bins]`` (masked, tempered)."""
        return torch.log_softmax(logits[..., self.actions.action_ids.to(logits.device)] / self.temperature, dim=-1)

    def _sample(self, logp: torch.Tensor, uniform: torch.Tensor | None) -> torch.Tensor:
        """The mode (``uniform=None``) or the inverse CDF at ``uniform [...]`` of ``logp [..., n_bins]``:
        bins ``[...]``."""
        if uniform is None:
            return logp.argmax(-1)
        cdf = logp.exp().cumsum(-1).contiguous()
        bins = torch.searchsorted(cdf, (uniform * cdf[..., -1]).unsqueeze(-1).contiguous()).squeeze(-1)
        return bins.clamp(max=self.actions.n_bins - 1)

    def _uniform(self, batch: int, deterministic: bool, noise: torch.Tensor | None, device) -> torch.Tensor | None:
        """``Phi(noise) [B, T]`` (fresh noise if none is given), or None for greedy decoding."""
        if deterministic:
            return None
        return torch.special.ndtr((torch.randn(batch, self.noise_dim) if noise is None else noise).to(device))

    def bin_distributions(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Teacher-forced log-probs of every bin at every action token ``[B, T, n_bins]`` given the
        sampled bins ``actions [B, T]``, and the value ``[B]``."""
        raise NotImplementedError

    def demo_loss(self, obs: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cross-entropy of the demo actions' tokens (``targets [B, chunk_size, action_dim]``,
        teacher-forced), and how often the most likely bin is the demo's (``token_accuracy``)."""
        bins = self.actions.bins(targets).flatten(1)
        logp, _ = self.bin_distributions(obs, bins.float())
        loss = -logp.gather(-1, bins.unsqueeze(-1)).squeeze(-1).mean()
        return {"loss": loss, "token_accuracy": (logp.argmax(-1) == bins).float().mean()}

    def token_logprobs(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """``(log-probs [B, T], entropies [B, T], value [B])`` of the bins ``actions``, token by token."""
        logp, value = self.bin_distributions(obs, actions)
        token_logp = logp.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return token_logp, -(logp.exp() * logp).sum(-1), value

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Token log-probs ``[B, T]`` (the update sums them to ``algorithm.logprob_level``), the
        entropy of the whole decision ``[B]`` and the value ``[B]``."""
        token_logp, entropy, value = self.token_logprobs(obs, actions)
        return token_logp, entropy.sum(-1), value

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Sampled bins ``[B, T]`` -> continuous env actions (bin centres, un-normalised, then the
        checkpoint family's gripper post-processing): ``[B, A]``, or ``[B, chunk_size, A]`` for chunks."""
        decoded = self.actions.decode(self.actions.action_ids.to(actions.device)[actions.long()].unflatten(
            -1, (self.chunk_size, self.action_dim)))
        decoded = self.adapter.actions(decoded)
        return decoded if self.chunk_size > 1 else decoded[:, 0]


class ParallelTokenPolicy(TokenActionPolicy):
    """Token policies whose one forward pass scores all ``T`` action tokens: nothing sampled is
    fed back, so sampling and the teacher-forced log-probs come from the same pass. A subclass
    implements :meth:`token_logits`."""

    def token_logits(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, T, V] of the T action tokens, value [B])``."""
        raise NotImplementedError

    def _parallel(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bin log-probs [B, T, n_bins], value [B])``."""
        logits, value = self.token_logits(obs)
        return self._bin_logprobs(logits), value

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        """Sampled (or greedy) bins ``[B, T]``, their log-probs ``[B, T]`` and the value ``[B]``."""
        logp, value = self._parallel(obs)
        bins = self._sample(logp, self._uniform(logp.shape[0], deterministic, noise, logp.device))
        return bins.float(), logp.gather(-1, bins.unsqueeze(-1)).squeeze(-1), value

    def bin_distributions(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Log-probs of every bin at every action token ``[B, T, n_bins]`` (they do not depend on
        ``actions``: nothing is fed back), and the value."""
        return self._parallel(obs)

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.token_logits(obs)[1]
