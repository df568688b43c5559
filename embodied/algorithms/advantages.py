"""Advantage estimators, registered by name (``algorithm.advantage``).

An estimator takes the time-major batch (``rewards``, ``values``, ``dones`` of shape
``[T, B]``, ``next_value[B]``: the value of the observation after the last step) and
the algorithm config, and returns ``(advantages[T, B], returns[T, B], valid[T, B])``;
``valid`` marks the samples the update trains on. ``dones[t]`` marks that the episode
ended *at* step ``t`` (terminated or truncated; time-limit bootstrapping is folded
into the reward by the rollout worker).
"""

from __future__ import annotations

import torch

from envs.common import Registry
from envs.messages import Trajectory

ADVANTAGES = Registry("advantage estimator (algorithm.advantage)")
# estimators that score whole episodes: each iteration resets the envs (in groups)
OUTCOME_ADVANTAGES = {"grpo"}


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
        gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016): ``(advantages, returns)``."""
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        not_done = (~dones[t].bool()).to(rewards.dtype)
        following = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * following * not_done - values[t]
        running = delta + gamma * gae_lambda * not_done * running
        advantages[t] = running
    return advantages, advantages + values


def first_episode_mask(dones: torch.Tensor) -> torch.Tensor:
    """``[T, B]`` bool: the steps of each env's first episode (up to and including its first done)."""
    ended_before = torch.cumsum(dones.long(), dim=0) - dones.long()  # dones strictly before step t
    return ended_before == 0


# how GRPO's loss weighs an episode's steps (algorithm.grpo_weighting): lengths [B] -> scale [B]
GRPO_WEIGHTINGS = Registry("GRPO weighting (algorithm.grpo_weighting)")


@GRPO_WEIGHTINGS.register("episode")
def _every_episode_the_same(lengths: torch.Tensor) -> torch.Tensor:
    trained = lengths > 0  # envs not trained on keep scale 1 (their advantages are masked anyway)
    if not bool(trained.any()):
        return torch.ones_like(lengths)
    return torch.where(trained, lengths[trained].mean() / lengths.clamp(min=1), torch.ones_like(lengths))


@GRPO_WEIGHTINGS.register("step")
def _every_step_the_same(lengths: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(lengths)


def grpo_advantages(rewards: torch.Tensor, dones: torch.Tensor, group_size: int,
                    filter_uniform: bool = False, weighting: str = "episode",
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantages (GRPO, Shao et al. 2024) for one episode per env.

    Env ``b`` belongs to group ``b // group_size``; a group's envs started from one initial
    state. Each env's first episode (it must end within the ``T`` steps) scores its return
    ``R_b``; every step of it gets ``(R_b - mean_g) / (std_g + eps)`` (``std``: unbiased, as
    GRPO). Returns ``(advantages[T, B], valid[T, B])``: ``valid`` covers the first episodes,
    minus, with ``filter_uniform``, groups whose returns are all equal (no signal).

    ``weighting``: the loss averages over steps, so an episode of ``L_b`` steps would weigh
    ``L_b`` times; ``"episode"`` (GRPO's ``1/|o_i|``) scales its advantages by ``mean(L) / L_b``
    so every episode weighs the same and a group's advantages still sum to zero over its
    steps. ``"step"`` (DAPO's token-level sum) leaves them: long episodes (failures, when
    success ends an episode) then outweigh short ones and the update pushes sampled actions
    down on balance.
    """
    T, B = rewards.shape
    if B % group_size:
        raise ValueError(f"batch of {B} envs does not split into groups of {group_size}")
    valid = first_episode_mask(dones) & dones.any(dim=0, keepdim=True)  # unfinished: no outcome
    outcome = (rewards * valid).sum(dim=0).view(-1, group_size)
    mean, std = outcome.mean(dim=1, keepdim=True), outcome.std(dim=1, keepdim=True)
    score = ((outcome - mean) / (std + eps)).view(B)
    if filter_uniform:
        varied = (outcome != outcome[:, :1]).any(dim=1, keepdim=True).expand(-1, group_size)
        valid = valid & varied.reshape(1, B)
    score = score * GRPO_WEIGHTINGS.get(weighting)(valid.sum(dim=0).to(score.dtype))
    return score.expand(T, B) * valid, valid


@ADVANTAGES.register("gae")
def gae_estimator(batch: Trajectory, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    advantages, returns = gae(batch.rewards, batch.values, batch.dones, batch.next_value,
                              gamma=cfg.gamma, gae_lambda=cfg.gae_lambda)
    return advantages, returns, torch.ones_like(batch.dones, dtype=torch.bool)


@ADVANTAGES.register("grpo")
def grpo_estimator(batch: Trajectory, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    advantages, valid = grpo_advantages(batch.rewards, batch.dones, cfg.group_size,
                                        cfg.filter_uniform_groups, cfg.grpo_weighting)
    return advantages, batch.values, valid  # returns = values: no value loss (there is no critic)
