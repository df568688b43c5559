"""The PPO update: advantages, then epochs of minibatch gradient steps.

Read top to bottom, CleanRL style. ``batch`` holds time-major tensors
``[T, B, ...]`` from the rollout workers.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from embodied.algorithms.advantages import ADVANTAGES
from embodied.algorithms.logprob_levels import group_logprobs
from embodied.algorithms.losses import LOSSES, critic_loss, kl_to_reference


def compute_advantages(batch: dict, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages[T, B], returns[T, B], valid[T, B])`` with the estimator ``cfg.advantage``."""
    return ADVANTAGES.get(cfg.advantage)(batch, cfg)


def flatten_time(batch: dict, advantages: torch.Tensor, returns: torch.Tensor,
                 valid: torch.Tensor | None = None) -> dict:
    """[T, B, ...] -> [N, ...] for the per-sample tensors the loss needs: the ``valid`` ones."""
    keep = valid.flatten(0, 1) if valid is not None else slice(None)
    flat = {
        "obs": {k: v.flatten(0, 1)[keep] for k, v in batch["obs"].items()},
        "actions": batch["actions"].flatten(0, 1)[keep],
        "logprobs": batch["logprobs"].flatten(0, 1)[keep],
        "values": batch["values"].flatten(0, 1)[keep],
    }
    flat["advantages"] = advantages.flatten(0, 1)[keep]
    flat["returns"] = returns.flatten(0, 1)[keep]
    return flat


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


def ppo_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, cfg,
               generator: torch.Generator | None = None, critic_only: bool = False,
               reference: nn.Module | None = None) -> dict[str, float]:
    """Run ``cfg.update_epochs`` epochs over ``batch``; returns mean training statistics.

    ``critic_only`` (critic warm-up): the loss is the value loss alone and only the critic's own
    parameters step, so the actor, shared encoder included, stays exactly as it was.
    ``reference`` (with ``cfg.kl_coef > 0``): a frozen policy; ``kl_coef * KL(policy || reference)``
    on the batch's actions joins the loss, holding the policy near its warm start.
    """
    critic = critic_parameters(policy) if critic_only else set()
    advantages, returns, valid = compute_advantages(batch, cfg)
    data = flatten_time(batch, advantages, returns, valid)
    n = data["actions"].shape[0]
    if n == 0:  # e.g. GRPO with every group filtered out: nothing to learn from this batch
        return {"samples": 0.0, "epochs": 0.0}
    minibatch = max(n // cfg.num_minibatches, 1)
    stats: dict[str, list[float]] = defaultdict(list)
    for _epoch in range(cfg.update_epochs):
        order = torch.randperm(n, generator=generator)
        epoch_kl = []
        for start in range(0, n, minibatch):
            idx = order[start:start + minibatch]
            adv = data["advantages"][idx]
            if cfg.normalize_advantages and len(idx) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            obs = {k: v[idx] for k, v in data["obs"].items()}
            new_logprob, entropy, new_value = policy.evaluate(obs, data["actions"][idx])
            loss, step_stats = LOSSES.get(cfg.loss)(
                group_logprobs(new_logprob, cfg.logprob_level, policy.action_dim),
                group_logprobs(data["logprobs"][idx], cfg.logprob_level, policy.action_dim), adv, new_value,
                data["values"][idx],
                data["returns"][idx], entropy, cfg,
            )
            if reference is not None and cfg.kl_coef > 0 and not critic_only:
                with torch.no_grad():
                    reference_logprob, _, _ = reference.evaluate(obs, data["actions"][idx])
                kl = kl_to_reference(new_logprob, reference_logprob)
                loss = loss + cfg.kl_coef * kl
                step_stats["kl_to_reference"] = kl.item()
            if critic_only:
                loss = cfg.vf_coef * critic_loss(new_value, data["values"][idx], data["returns"][idx], cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if critic_only:
                for param in policy.parameters():
                    if id(param) not in critic:
                        param.grad = None  # Adam skips a parameter without a gradient
            grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            step_stats["grad_norm"] = float(grad_norm)
            for key, value in step_stats.items():
                stats[key].append(value)
            epoch_kl.append(step_stats["approx_kl"])
        stats["epochs"].append(1.0)
        if cfg.target_kl is not None and sum(epoch_kl) / len(epoch_kl) > cfg.target_kl:
            break
    out = {k: sum(v) / len(v) for k, v in stats.items() if k != "epochs"}
    out["epochs"] = float(len(stats["epochs"]))
    out["samples"] = float(n)
    out["critic_only"] = float(critic_only)
    var_returns = data["returns"].var()
    out["explained_variance"] = float(1 - (data["returns"] - data["values"]).var() / var_returns) if var_returns > 0 else 0.0
    return out
