"""Policy-gradient losses, registered by name (``algorithm.loss``).

A loss takes one minibatch's :class:`LossTerms` and the algorithm config and returns
``(loss, stats)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from envs.common import Registry

LOSSES = Registry("loss (algorithm.loss)")


@dataclass
class LossTerms:
    """One minibatch of ``N`` samples, flat. Log-probs are ``[N, G]`` (``G`` ratios per sample,
    see logprob_levels.py) or ``[N]``; the rest ``[N]``. ``new_*`` carry gradients."""

    new_logprob: torch.Tensor
    old_logprob: torch.Tensor  # the rollout's
    advantages: torch.Tensor
    new_value: torch.Tensor
    old_value: torch.Tensor  # the rollout's
    returns: torch.Tensor
    entropy: torch.Tensor


def critic_loss(new_value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor, cfg) -> torch.Tensor:
    """``0.5 * mean((V - R)^2)``; with ``clip_vloss``, V moves at most ``clip_coef`` from the rollout's value."""
    if cfg.clip_vloss:
        clipped = old_value + (new_value - old_value).clamp(-cfg.clip_coef, cfg.clip_coef)
        return 0.5 * torch.max((new_value - returns) ** 2, (clipped - returns) ** 2).mean()
    return 0.5 * ((new_value - returns) ** 2).mean()


def kl_to_reference(logprob: torch.Tensor, reference_logprob: torch.Tensor) -> torch.Tensor:
    """Mean k3 estimate of ``KL(policy || reference)`` over the sampled units (tokens, or action
    dimensions): ``exp(ref - new) - (ref - new) - 1``, >= 0 for every sample, and unbiased when the
    samples come from the policy (Schulman, "Approximating KL divergence"; GRPO's beta term)."""
    log_ratio = reference_logprob - logprob
    return (log_ratio.exp() - log_ratio - 1).mean()


@LOSSES.register("ppo")
def ppo_loss(terms: LossTerms, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + (optionally clipped) value loss - entropy bonus.

    ``loss = -mean(min(r A, clip(r, 1-c, 1+c_high) A)) + vf_coef * 0.5 * mean((V - R)^2)
    - ent_coef * mean(H)`` with ``r = exp(new_logprob - old_logprob)`` and ``c_high``
    = ``clip_coef_high`` (asymmetric clipping) or ``clip_coef``.
    """
    new_logprob, old_logprob, advantages = terms.new_logprob, terms.old_logprob, terms.advantages
    log_ratio = new_logprob - old_logprob
    ratio = log_ratio.exp()
    if ratio.dim() > advantages.dim():  # several units per sample share its advantage
        advantages = advantages.unsqueeze(-1)
    clip_high = cfg.clip_coef if cfg.clip_coef_high is None else cfg.clip_coef_high
    policy_loss = torch.max(
        -advantages * ratio,
        -advantages * ratio.clamp(1 - cfg.clip_coef, 1 + clip_high),
    ).mean()
    value_loss = critic_loss(terms.new_value, terms.old_value, terms.returns, cfg)
    entropy_mean = terms.entropy.mean()
    loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy_mean
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.item(),
            "value_loss": value_loss.item(),
            "entropy": entropy_mean.item(),
            # KL(old || new), the old policy having sampled the actions
            "approx_kl": kl_to_reference(old_logprob, new_logprob).item(),
            "clip_fraction": ((ratio < 1 - cfg.clip_coef) | (ratio > 1 + clip_high)).float().mean().item(),
        }
    return loss, stats
