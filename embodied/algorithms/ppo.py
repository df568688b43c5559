"""PPO (:class:`PPO`, ``algorithm=ppo``): advantages, then epochs of minibatch gradient steps.

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

from embodied.algorithms.advantages import ADVANTAGES, OUTCOME_ADVANTAGES
from embodied.algorithms.base import ALGORITHMS, Algorithm
from embodied.algorithms.logprob_levels import LOGPROB_LEVELS, group_logprobs
from embodied.algorithms.losses import LOSSES, LossTerms, critic_loss, kl_to_reference
from envs.common import UserError
from envs.messages import Trajectory
from scheduler.runtime.data_parallel import SINGLE, DataParallel


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
               generator: torch.Generator | None = None, reference: nn.Module | None = None,
               dp: DataParallel = SINGLE) -> dict[str, float]:
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

    return _epochs(policy, optimizer, batch, cfg, generator, minibatch_loss, steps=None, dp=dp) | {"critic_only": 0.0}


def critic_warmup_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, cfg,
                         generator: torch.Generator | None = None, dp: DataParallel = SINGLE) -> dict[str, float]:
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

    stats = _epochs(policy, optimizer, batch, cfg, generator, minibatch_loss, steps=critic_parameters(policy), dp=dp)
    return stats | {"critic_only": 1.0}


def _epochs(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, cfg,
            generator: torch.Generator | None, minibatch_loss: MinibatchLoss,
            steps: set[int] | None, dp: DataParallel = SINGLE) -> dict[str, float]:
    """The epochs both updates share: advantages, shuffled minibatches (advantages normalised
    per minibatch), a clipped gradient step on ``minibatch_loss``, early stop past
    ``cfg.target_kl``. ``steps``: ``id``s of the only parameters that may step (None: all).

    ``batch`` holds this rank's envs (``dp``: its place among the actor ranks). The ranks share
    their samples' scalars, so each computes the whole batch's advantages and draws the same
    minibatches; a rank trains on the samples of a minibatch it holds, its loss weighted by their
    share, and the summed gradients, statistics and early stop are those of one rank holding all."""
    scores = _whole_batch_scores(batch, dp)
    advantages, returns, valid = compute_advantages(scores, cfg)
    data = flatten_time(scores, advantages, returns, valid)
    n = len(data)
    if n == 0:  # e.g. GRPO with every group filtered out: nothing to learn from this batch
        return {"samples": 0.0, "epochs": 0.0}
    owner, local_index = sample_owners(valid, batch.num_envs)
    local_obs = {k: v.flatten(0, 1) for k, v in batch.obs.items()}
    minibatch = max(n // cfg.num_minibatches, 1)
    stats: dict[str, list[float]] = defaultdict(list)
    epochs = 0
    for _epoch in range(cfg.update_epochs):
        order = torch.randperm(n, generator=generator)
        epoch_kl = []
        for start in range(0, n, minibatch):
            idx = order[start:start + minibatch]
            mb = data.take(idx)
            if cfg.normalize_advantages and len(mb) > 1:
                mb.advantages = (mb.advantages - mb.advantages.mean()) / (mb.advantages.std() + 1e-8)
            mine, share = _this_ranks_part(owner[idx], dp.rank)
            part = mb.take(mine)
            part.obs = {k: v[local_index[idx[mine]]] for k, v in local_obs.items()}
            loss, step_stats = minibatch_loss(part, part.advantages)
            optimizer.zero_grad(set_to_none=True)
            weight = share * dp.loss_scale
            (loss if weight == 1.0 else loss * weight).backward()
            dp.sum_gradients(policy)
            step_stats = _sum_over_ranks(step_stats, share, dp)
            if steps is not None:
                for param in policy.parameters():
                    if id(param) not in steps:
                        param.grad = None  # Adam skips a parameter without a gradient
            step_stats["grad_norm"] = _float(nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
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


def _whole_batch_scores(batch: Trajectory, dp: DataParallel) -> Trajectory:
    """Every rank's envs, joined in rank order, but without observations: the scalars the
    advantages, minibatches and normalisation are computed from (``[T, B_all]``)."""
    return batch.map(lambda x: dp.gather_envs(x, 1), lambda x: dp.gather_envs(x, 0), obs=False)


def sample_owners(valid: torch.Tensor, envs_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample of the whole batch (``valid [T, B]``, in ``flatten_time``'s step-major
    order), the rank whose envs it is of (ranks hold ``envs_per_rank`` consecutive envs each) and
    its index in that rank's flattened ``[T * envs_per_rank]`` batch. Both ``[N]``."""
    position = valid.flatten().nonzero().squeeze(1)
    step, env = position // valid.shape[1], position % valid.shape[1]
    return env // envs_per_rank, step * envs_per_rank + env % envs_per_rank


def _this_ranks_part(owners: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """Indices of a minibatch's samples this rank holds, and their share of it. A rank holding
    none trains on its first sample with weight 0: every rank runs the same passes (FSDP's
    collectives are in them) and adds nothing."""
    mine = (owners == rank).nonzero().squeeze(1)
    if len(mine) == 0:
        return torch.zeros(1, dtype=torch.long), 0.0
    return mine, len(mine) / len(owners)


def _sum_over_ranks(stats: dict[str, float], share: float, dp: DataParallel) -> dict[str, float]:
    """A minibatch's statistics (means over its samples) from every rank's means over its part."""
    if dp.world == 1:
        return stats
    keys = sorted(stats)
    total = dp.sum(torch.tensor([stats[k] * share for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist(), strict=True))


def _float(norm: torch.Tensor) -> float:
    """A gradient norm as a float (FSDP's is a DTensor over the ranks)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@ALGORITHMS.register("ppo")
class PPO(Algorithm):
    """Proximal policy optimisation on fixed-length rollouts, with a value function (GAE).

    ``algorithm.critic_warmup_iterations`` > 0: the first updates train the critic alone
    (:func:`critic_warmup_update`), then :func:`ppo_update`."""

    has_critic = True  # the advantages use the value function (GAE), so there is one to train

    def check(self, run_cfg, rollout_only: bool = False) -> None:
        algo = run_cfg.algorithm
        for registry, name in ((ADVANTAGES, algo.advantage), (LOSSES, algo.loss), (LOGPROB_LEVELS, algo.logprob_level)):
            registry.get(name)
        if (algo.advantage in OUTCOME_ADVANTAGES) != self.episodic:
            raise UserError(f"algorithm.advantage={algo.advantage} does not fit algorithm={algo.name}: an estimator "
                            f"that scores whole episodes needs iterations of whole episodes, and "
                            f"{'only' if self.episodic else 'no'} such estimators fit this algorithm. Choose the "
                            f"algorithm by its config (algorithm=ppo or algorithm=grpo) rather than its advantage.")
        if algo.critic_warmup_iterations and (algo.vf_coef == 0 or not self.has_critic):
            raise UserError(f"algorithm.critic_warmup_iterations={algo.critic_warmup_iterations} trains only the "
                            f"value function, but algorithm={algo.name} (advantage {algo.advantage}, vf_coef "
                            f"{algo.vf_coef}) uses none: those updates would change nothing. Set "
                            "algorithm.critic_warmup_iterations=0, or use PPO (algorithm=ppo).")

    def make_optimizer(self, policy: nn.Module) -> torch.optim.Optimizer:
        """Adam over the trainable parameters (LoRA: adapters + value head), the critic's own in a
        group at ``critic_lr`` if it is set (:func:`optimizer_groups`)."""
        return torch.optim.Adam(optimizer_groups(policy, self.cfg), lr=self.cfg.lr, eps=1e-5)

    def update(self, policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, *, iteration: int = 0,
               generator: torch.Generator | None = None, reference: nn.Module | None = None,
               dp: DataParallel = SINGLE) -> dict[str, float]:
        if iteration < self.cfg.critic_warmup_iterations:
            return critic_warmup_update(policy, optimizer, batch, self.cfg, generator=generator, dp=dp)
        return ppo_update(policy, optimizer, batch, self.cfg, generator=generator, reference=reference, dp=dp)

    def profiled_update(self, policy: nn.Module, optimizer: torch.optim.Optimizer,
                        batch: Trajectory) -> dict[str, float]:
        return ppo_update(policy, optimizer, batch, self.cfg)  # critic warm-up updates are the few, not the many
