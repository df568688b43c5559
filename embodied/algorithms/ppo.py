"""The PPO update: advantages, then epochs of minibatch gradient steps.

Read top to bottom, CleanRL style. A :class:`~envs.messages.Trajectory` from the rollout
workers is time-major (``[T, B, ...]``); :func:`flatten_time` turns it into the ``N``
samples the epochs draw minibatches from. Two updates share the epochs:

- :func:`ppo_update`: the policy's loss (``algorithm.loss``; GRPO trains only the samples its
  advantage estimator marks valid), with an optional KL penalty to a reference policy;
- :func:`critic_warmup_update`: the value loss alone, stepping only the critic's own
  parameters (``algorithm.critic_warmup_iterations`` after a warm start).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from embodied.algorithms.advantages import ADVANTAGES
from embodied.algorithms.logprob_levels import group_logprobs
from embodied.algorithms.losses import LOSSES, LossTerms, critic_loss, kl_to_reference
from envs.messages import Trajectory


def compute_advantages(batch: Trajectory, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages[T, B], returns[T, B], valid[T, B])`` with the estimator ``cfg.advantage``."""
    return ADVANTAGES.get(cfg.advantage)(batch, cfg)


@dataclass
class Samples:
    """``N`` flat samples: ``obs`` ``[N, ...]`` per key, ``actions`` ``[N, A]``, the rest ``[N]``."""

    obs: dict[str, torch.Tensor]
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def __len__(self) -> int:
        return self.actions.shape[0]

    def take(self, idx: torch.Tensor) -> Samples:
        return Samples({k: v[idx] for k, v in self.obs.items()}, self.actions[idx], self.logprobs[idx],
                       self.values[idx], self.advantages[idx], self.returns[idx])


def flatten_time(batch: Trajectory, advantages: torch.Tensor, returns: torch.Tensor,
                 valid: torch.Tensor | None = None) -> Samples:
    """[T, B, ...] -> [N, ...] for the per-sample tensors the loss needs: the ``valid`` ones."""
    keep = valid.flatten(0, 1) if valid is not None else slice(None)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1)[keep]

    return Samples({k: flat(v) for k, v in batch.obs.items()}, flat(batch.actions), flat(batch.logprobs),
                   flat(batch.values), flat(advantages), flat(returns))


def critic_parameters(policy: nn.Module) -> set[int]:
    """``id``s of the parameters only the value function uses: the modules named in the policy's
    ``critic_modules`` (a shared encoder is the actor's too, so it is not among them)."""
    return {id(p) for name in policy.critic_modules for p in policy.get_submodule(name).parameters()}


def optimizer_groups(policy: nn.Module, cfg) -> list[dict]:
    """The trainable parameters as optimizer groups: one at ``cfg.lr``, or, with ``cfg.critic_lr``,
    the critic's own parameters in a second group at that rate. ``lr_scale`` is each group's rate
    over ``cfg.lr``, which annealing keeps (see ``ActorWorker.set_lr``)."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    if cfg.critic_lr is None:
        return [{"params": trainable, "lr": cfg.lr, "lr_scale": 1.0}]
    critic = critic_parameters(policy)
    return [{"params": [p for p in trainable if id(p) not in critic], "lr": cfg.lr, "lr_scale": 1.0},
            {"params": [p for p in trainable if id(p) in critic], "lr": cfg.critic_lr,
             "lr_scale": cfg.critic_lr / cfg.lr}]


MinibatchLoss = Callable[[Samples, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def ppo_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, cfg,
               generator: torch.Generator | None = None, reference: nn.Module | None = None) -> dict[str, float]:
    """Run ``cfg.update_epochs`` epochs of ``cfg.loss`` over ``batch``; returns mean training statistics.

    ``reference`` (with ``cfg.kl_coef > 0``): a frozen policy; ``kl_coef * KL(policy || reference)``
    on the batch's actions joins the loss, holding the policy near its warm start.
    """
    loss_fn = LOSSES.get(cfg.loss)

    def minibatch_loss(mb: Samples, advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        new_logprob, entropy, new_value = policy.evaluate(mb.obs, mb.actions)
        loss, stats = loss_fn(LossTerms(
            group_logprobs(new_logprob, cfg.logprob_level, policy.action_dim),
            group_logprobs(mb.logprobs, cfg.logprob_level, policy.action_dim),
            advantages, new_value, mb.values, mb.returns, entropy), cfg)
        if reference is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                reference_logprob, _, _ = reference.evaluate(mb.obs, mb.actions)
            kl = kl_to_reference(new_logprob, reference_logprob)
            loss = loss + cfg.kl_coef * kl
            stats["kl_to_reference"] = kl.item()
        return loss, stats

    return _epochs(policy, optimizer, batch, cfg, generator, minibatch_loss, steps=None) | {"critic_only": 0.0}


def critic_warmup_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, cfg,
                         generator: torch.Generator | None = None) -> dict[str, float]:
    """Epochs of ``vf_coef`` times the value loss alone, and only the critic's own parameters step, so
    the actor, shared encoder included, stays exactly as it was (``approx_kl`` is still reported and
    still stops the epochs past ``target_kl``, as in :func:`ppo_update`)."""

    def minibatch_loss(mb: Samples, advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        new_logprob, _, new_value = policy.evaluate(mb.obs, mb.actions)
        value_loss = critic_loss(new_value, mb.values, mb.returns, cfg)
        with torch.no_grad():
            approx_kl = kl_to_reference(group_logprobs(mb.logprobs, cfg.logprob_level, policy.action_dim),
                                        group_logprobs(new_logprob, cfg.logprob_level, policy.action_dim))
        return cfg.vf_coef * value_loss, {"value_loss": value_loss.item(), "approx_kl": approx_kl.item()}

    stats = _epochs(policy, optimizer, batch, cfg, generator, minibatch_loss, steps=critic_parameters(policy))
    return stats | {"critic_only": 1.0}


def _epochs(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, cfg,
            generator: torch.Generator | None, minibatch_loss: MinibatchLoss,
            steps: set[int] | None) -> dict[str, float]:
    """The epochs both updates share: advantages, shuffled minibatches (advantages normalised
    per minibatch), a clipped gradient step on ``minibatch_loss``, early stop past
    ``cfg.target_kl``. ``steps``: ``id``s of the only parameters that may step (None: all)."""
    advantages, returns, valid = compute_advantages(batch, cfg)
    data = flatten_time(batch, advantages, returns, valid)
    n = len(data)
    if n == 0:  # e.g. GRPO with every group filtered out: nothing to learn from this batch
        return {"samples": 0.0, "epochs": 0.0}
    minibatch = max(n // cfg.num_minibatches, 1)
    stats: dict[str, list[float]] = defaultdict(list)
    epochs = 0
    for _epoch in range(cfg.update_epochs):
        order = torch.randperm(n, generator=generator)
        epoch_kl = []
        for start in range(0, n, minibatch):
            mb = data.take(order[start:start + minibatch])
            adv = mb.advantages
            if cfg.normalize_advantages and len(mb) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            loss, step_stats = minibatch_loss(mb, adv)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if steps is not None:
                for param in policy.parameters():
                    if id(param) not in steps:
                        param.grad = None  # Adam skips a parameter without a gradient
            step_stats["grad_norm"] = float(nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
            optimizer.step()
            for key, value in step_stats.items():
                stats[key].append(value)
            epoch_kl.append(step_stats["approx_kl"])
        epochs += 1
        if cfg.target_kl is not None and sum(epoch_kl) / len(epoch_kl) > cfg.target_kl:
            break
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    out["epochs"] = float(epochs)
    out["samples"] = float(n)
    var_returns = data.returns.var()
    residual = (data.returns - data.values).var()
    out["explained_variance"] = float(1 - residual / var_returns) if var_returns > 0 else 0.0
    return out
