"""Soft actor-critic (``algorithm=sac``): off-policy, from a replay buffer.

Read top to bottom, CleanRL style. Each iteration the rollout workers collect
``algorithm.rollout_steps`` steps of every env with next observations (:class:`Collection`
``next_obs``); :meth:`SAC.update` adds them to the replay buffer (embodied/algorithms/replay.py)
and, once it holds ``sac.learning_starts`` transitions, takes ``sac.utd`` gradient steps per env
step collected, each on ``sac.batch_size`` transitions:

- critics: every ``Q_i(s, a)`` regresses to :func:`soft_bellman_target`, computed with the
  target critics (a Polyak average of the critics, ``sac.tau``) and a fresh action from the policy;
- actor (every ``sac.actor_every`` steps): minimise ``alpha * log pi(a|s) - min_i Q_i(s, a)``
  through a reparameterised sample;
- temperature (``sac.autotune``): ``alpha`` rises when the policy's entropy falls below
  ``sac.target_entropy`` and falls when it is above.

The policy holds the actor and the critics (``soft_actor_critic`` policies, e.g. ``mlp_sac``); the
target critics, the temperature, its optimizer and the replay buffer are this object's state,
saved with every checkpoint (the buffer if ``sac.save_buffer``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch
from torch import nn
from torch.func import functional_call

from embodied.algorithms.base import ALGORITHMS, BOOTSTRAP_MASKS, Algorithm, Collection
from embodied.algorithms.replay import ReplayBuffer, Transitions, transitions
from envs.common import UserError
from envs.demos import PLANNERS
from envs.messages import Trajectory
from policies.base import POLICIES
from policies.registry import check_policy_name
from scheduler.runtime.data_parallel import SINGLE, DataParallel


def soft_bellman_target(rewards: torch.Tensor, discounts: torch.Tensor, next_q: torch.Tensor,
                        next_logprob: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """``y = R + discount * (min_i Q'_i(s', a') - alpha * log pi(a'|s'))``, ``a' ~ pi(s')``.

    ``rewards``, ``discounts``, ``next_logprob``: ``[N]``; ``next_q``: ``[num_q, N]``, the target
    critics at ``(s', a')``. A discount of 0 (a terminal state) leaves the reward alone.
    """
    return rewards + discounts * (next_q.min(0).values - alpha * next_logprob)


def check_soft_actor_critic(policy_name: str) -> None:
    """SAC trains a policy with a squashed Gaussian actor and Q critics; others are refused."""
    check_policy_name(policy_name)
    if not getattr(POLICIES.get(policy_name), "soft_actor_critic", False):
        raise UserError(f"algorithm=sac cannot train policy={policy_name}: SAC needs a policy with a "
                        "reparameterisable squashed Gaussian actor and Q critics Q(s, a) (policies/mlp_sac.py). "
                        "Use policy=mlp_sac, or an on-policy algorithm (algorithm=ppo, algorithm=grpo).")


def check_demos_exist(env_cfg) -> None:
    """RLPD draws from motion-planner demos: the task must have a planner (envs/demos.py)."""
    if env_cfg.backend != "maniskill" or env_cfg.task not in PLANNERS:
        raise UserError(f"algorithm.sac.demo_fraction mixes motion-planner demos into SAC's batches, but "
                        f"env.backend={env_cfg.backend} env.task={env_cfg.task} has no planner (the ManiSkill tasks "
                        f"with one: {', '.join(PLANNERS)}). Set algorithm.sac.demo_fraction=0, or one of those tasks.")


@ALGORITHMS.register("sac")
class SAC(Algorithm):
    """Soft actor-critic over a replay buffer (module docstring)."""

    off_policy = True
    max_actor_ranks = 1  # the replay buffer and the target critics are one rank's

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sac = cfg.sac
        self.buffer = ReplayBuffer(cfg.sac.buffer_size, setting="algorithm.sac.buffer_size")
        self.demos: ReplayBuffer | None = None  # RLPD (sac.demo_fraction > 0): the demonstrations' transitions
        self.target: dict[str, torch.Tensor] | None = None  # the target critics' parameters, by name
        self.log_alpha = torch.tensor(math.log(cfg.sac.alpha), requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.sac.alpha_lr)
        self.owed_steps = 0.0  # gradient steps the collected data has earned and not yet taken (a fraction)
        self.gradient_steps = 0
        self.fallback_generator = torch.Generator().manual_seed(0)  # for callers that pass none (the actor does)

    @property
    def collection(self) -> Collection:
        return Collection(next_obs=True)

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.detach().exp()

    def check(self, run_cfg, rollout_only: bool = False) -> None:
        check_soft_actor_critic(run_cfg.policy.name)
        if run_cfg.placement.actor_workers > self.max_actor_ranks:
            raise UserError(f"placement.actor_workers={run_cfg.placement.actor_workers}: SAC trains on one actor "
                            "rank (its replay buffer and target critics are that rank's). Set "
                            "placement.actor_workers=1.")
        if self.uses_demos:
            check_demos_exist(run_cfg.env)

    def make_optimizer(self, policy: nn.Module) -> torch.optim.Optimizer:
        """Adam, the actor's parameters at ``algorithm.lr``, the critics' at ``sac.q_lr``; each step
        moves only the parameters its loss has gradients for. ``foreach``: one kernel per update over all
        tensors, not one per tensor (torch's default on CPU), 12% off a gradient step of two 256-unit critics."""
        critic = {id(p) for p in policy.critic.parameters()}
        trainable = [p for p in policy.parameters() if p.requires_grad]
        q_lr = self.sac.q_lr or self.cfg.lr
        return torch.optim.Adam([
            {"params": [p for p in trainable if id(p) not in critic], "lr": self.cfg.lr, "lr_scale": 1.0},
            {"params": [p for p in trainable if id(p) in critic], "lr": q_lr, "lr_scale": q_lr / self.cfg.lr},
        ], foreach=True)

    def uniform_actions(self, env_steps: int) -> bool:
        """Until the buffer holds ``sac.learning_starts`` transitions (as CleanRL's and ManiSkill's SAC)."""
        return env_steps < self.sac.learning_starts

    @property
    def uses_demos(self) -> bool:
        return self.sac.demo_fraction > 0

    def load_demos(self, demos: Transitions) -> None:
        self.demos = ReplayBuffer(len(demos), setting="sft.demos")
        self.demos.add(demos)

    def sample(self, generator: torch.Generator) -> Transitions:
        """A batch of ``sac.batch_size``: ``sac.demo_fraction`` of it from the demos (RLPD), the rest replayed."""
        from_demos = round(self.sac.batch_size * self.sac.demo_fraction) if self.demos is not None else 0
        replayed = self.buffer.sample(self.sac.batch_size - from_demos, generator)
        return Transitions.cat([replayed, self.demos.sample(from_demos, generator)]) if from_demos else replayed

    def describe(self, obs_spec: dict, action_dim: int) -> list[str]:
        kept = "saved with every checkpoint" if self.sac.save_buffer else "not saved (sac.save_buffer=false)"
        return [f"replay buffer: {self.sac.buffer_size:,} transitions, {self.resident_mib(obs_spec, action_dim):,.0f} "
                f"MiB when full, on the actor's device; {kept}"]

    def resident_mib(self, obs_spec: dict, action_dim: int) -> float:
        return ReplayBuffer.bytes_for(self.sac.buffer_size, obs_spec, action_dim) / 2**20

    def resident_description(self, obs_spec: dict, action_dim: int) -> str:
        """What :meth:`resident_mib` counts, for the memory plan (embodied/memory_plan.py)."""
        return (f"the replay buffer (algorithm.sac.buffer_size={self.sac.buffer_size:,} transitions of "
                f"{ReplayBuffer.bytes_for(1, obs_spec, action_dim):,} bytes)")

    def resident_setting_that_fits(self, obs_spec: dict, action_dim: int, budget: int) -> str | None:
        """The largest ``algorithm.sac.buffer_size`` (two significant digits) whose full buffer takes at most
        ``budget`` bytes; None where not even ``sac.learning_starts`` transitions (or one batch) fit."""
        fits = max(budget, 0) // ReplayBuffer.bytes_for(1, obs_spec, action_dim)
        if fits < max(self.sac.learning_starts, self.sac.batch_size, 1):
            return None
        step = 10 ** max(len(str(fits)) - 2, 0)
        return f"algorithm.sac.buffer_size={fits // step * step}"

    def target_entropy(self, policy: nn.Module) -> float:
        return self.sac.target_entropy if self.sac.target_entropy is not None else -float(policy.action_dim)

    # -- the update --------------------------------------------------------------------------------
    def update(self, policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Trajectory, *, iteration: int = 0,
               generator: torch.Generator | None = None, reference: nn.Module | None = None,
               dp: DataParallel = SINGLE) -> dict[str, float]:
        """Add ``batch`` to the buffer, then the gradient steps it earns (``sac.utd`` per transition)."""
        self._start(policy)
        self.buffer.add(self.transitions(batch))
        stats: dict[str, list[float]] = defaultdict(list)
        if len(self.buffer) >= self.sac.learning_starts:
            self.owed_steps += self.sac.utd * batch.steps * batch.num_envs
            while self.owed_steps >= 1:
                self.owed_steps -= 1
                for key, value in self.gradient_step(policy, optimizer, generator).items():
                    stats[key].append(value)
        out = {key: sum(values) / len(values) for key, values in stats.items()}
        return out | {"buffer_size": float(len(self.buffer)), "gradient_steps": float(self.gradient_steps),
                      "replay_ratio": self.gradient_steps * self.sac.batch_size / max(self.buffer.added, 1),
                      "alpha": float(self.alpha), "samples": float(batch.steps * batch.num_envs)}

    def profiled_update(self, policy: nn.Module, optimizer: torch.optim.Optimizer,
                        batch: Trajectory) -> dict[str, float]:
        """A steady-state iteration's update (auto placement times it): ``batch`` added to a buffer past
        ``sac.learning_starts``, then its ``sac.utd`` gradient steps per transition. The buffer is a scratch
        one of the batch's size: profiling allocates no full buffer (:meth:`resident_mib` counts it), and a
        sample costs the same from any size."""
        scratch = SAC(dataclasses.replace(self.cfg, sac=dataclasses.replace(
            self.sac, buffer_size=batch.steps * batch.num_envs, learning_starts=0)))
        scratch.target = self.target
        stats = scratch.update(policy, optimizer, batch)
        self.target = scratch.target  # the next profiled update starts where this one left its critics
        return stats

    def transitions(self, batch: Trajectory) -> Transitions:
        """The batch's transitions; the target bootstraps where an episode goes on or the bootstrap rule
        (``algorithm.bootstrap``) says an ended one does (``time_limit``: truncations, not terminations)."""
        truncated = batch.dones & ~batch.terminated
        bootstraps = ~batch.dones | BOOTSTRAP_MASKS.get(self.cfg.bootstrap)(batch.terminated, truncated)
        return transitions(batch, self.cfg.gamma, self.sac.n_step, bootstraps)

    def gradient_step(self, policy: nn.Module, optimizer: torch.optim.Optimizer,
                      generator: torch.Generator | None) -> dict[str, float]:
        """One critic step on a sampled batch, then (every ``actor_every``) the actor's and the temperature's,
        then (every ``target_every``) the target critics' Polyak step."""
        mb = self.sample(generator or self.fallback_generator)
        alpha = self.alpha.to(mb.rewards.device)
        with torch.no_grad():
            next_actions, next_logprob = policy.sample(mb.next_obs)
            next_q = functional_call(policy.critic, self.target, (policy.critic_input(mb.next_obs), next_actions))
            target = soft_bellman_target(mb.rewards, mb.discounts, next_q, next_logprob, alpha)
        q = policy.critic(policy.critic_input(mb.obs), mb.actions)
        q_loss = ((q - target) ** 2).mean(1).sum()
        _step(optimizer, q_loss)
        stats = {"q_loss": q_loss.item(), "q_mean": q.mean().item(), "target_q_mean": target.mean().item()}
        self.gradient_steps += 1
        if self.gradient_steps % self.sac.actor_every == 0:
            stats |= self._actor_step(policy, optimizer, mb, alpha)
        if self.gradient_steps % self.sac.target_every == 0:
            with torch.no_grad():
                for name, param in policy.critic.named_parameters():
                    self.target[name].lerp_(param, self.sac.tau)
        return stats

    def _actor_step(self, policy: nn.Module, optimizer: torch.optim.Optimizer, mb: Transitions,
                    alpha: torch.Tensor) -> dict[str, float]:
        critic = list(policy.critic.parameters())
        for param in critic:  # the critics are what the actor climbs, not what it moves: no gradients for them
            param.requires_grad_(False)
        try:
            actions, logprob = policy.sample(mb.obs)
            q = policy.critic(policy.critic_input(mb.obs), actions).min(0).values
            actor_loss = (alpha * logprob - q).mean()
            _step(optimizer, actor_loss)
        finally:
            for param in critic:
                param.requires_grad_(True)
        stats = {"actor_loss": actor_loss.item(), "entropy": -logprob.mean().item()}
        if self.sac.autotune:
            entropy_gap = (logprob.detach() + self.target_entropy(policy)).mean().cpu()
            alpha_loss = -self.log_alpha.exp() * entropy_gap
            _step(self.alpha_optimizer, alpha_loss)
            stats["alpha_loss"] = alpha_loss.item()
        return stats

    def _start(self, policy: nn.Module) -> None:
        """The target critics, as copies of the critics, at the first update (unless a checkpoint gave them)."""
        if self.target is None:
            self.target = {name: p.detach().clone() for name, p in policy.critic.named_parameters()}
        device = next(policy.critic.parameters()).device
        self.target = {name: t.to(device) for name, t in self.target.items()}
        self.buffer.to(device)  # a loaded buffer comes on the CPU

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"target": None if self.target is None else {k: v.cpu() for k, v in self.target.items()},
                "log_alpha": self.log_alpha.detach().clone(), "alpha_optimizer": self.alpha_optimizer.state_dict(),
                "owed_steps": self.owed_steps, "gradient_steps": self.gradient_steps,
                "buffer": self.buffer.state_dict() if self.sac.save_buffer else None}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.target = state["target"]
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.owed_steps, self.gradient_steps = state["owed_steps"], state["gradient_steps"]
        if state["buffer"] is not None:
            self.buffer.load_state_dict(state["buffer"])


def _step(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """A gradient step on ``loss``: only the parameters it has gradients for move (Adam skips a parameter
    without a gradient)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
