"""Chain-sampled policies: a flow-matching action head integrates a chunk of actions from Gaussian
noise over ``K`` denoising steps (pi0-style), and RL scores the chain it sampled.

``D = chunk_size * A`` numbers make one decision (``A``: the env's action size). A rollout runs the
chain ``x_0 .. x_K`` (``x_0`` the noise, ``x_K`` the normalised chunk; step formulas in
policies/flow_steps.py) with some steps stochastic, as ``policy.flow.method`` says
(:data:`FLOW_METHODS`):

- ``sde`` (:class:`FlowSDE`): one step per sample (drawn, or ``policy.flow.sde_step``) is a
  Flow-SDE step, the others ODE steps; the log-probability is that step's Gaussian log-density;
- ``noise`` (:class:`FlowNoise`): every step is the ODE mean plus noise of a learned std (the
  policy's noise head, bounded by ``policy.flow.noise_min`` / ``noise_max``); the log-probability
  is the mean of the initial noise's and the ``K`` steps' log-densities.

The policy's ``actions`` are the chain itself and which step was stochastic, ``[B, (K + 1) * D + 1]``
(``x_0 .. x_K`` flattened, then the step, -1 for all): the update re-scores the stored transitions
with the new weights, never the noise. ``log_prob`` is ``[B, chunk_size * A]``, one term per number of
the chunk the env executes (:meth:`FlowMatchingPolicy.scored`: a chain wider than that, pi0's, scores only
these; ``algorithm.logprob_level`` sums them per action or per chunk). ``act(deterministic=True)`` is
the ODE alone over ``policy.flow.eval_steps`` from the caller's ``x_0``. ``noise [B, noise_dim]``,
``noise_dim = (K + 1) * D + 1``: ``x_0``, each step's draw and one draw that picks the Flow-SDE step.

A subclass provides the trunk and the networks: :meth:`FlowMatchingPolicy.heads` (features
``[B, F]`` and value ``[B]``), :meth:`~FlowMatchingPolicy.velocity` and, for Flow-Noise,
:meth:`~FlowMatchingPolicy.noise_std`; its observation encoder's modules are ``trunk_modules``.
"""

from __future__ import annotations

import math

import torch

from envs.common import Registry, UserError
from policies.base import Policy, rowwise_exact
from policies.flow_steps import gaussian_entropy, gaussian_logprob, ode_mean, sde_step, time_grid
from policies.vla.action_tokenizer import ActionStats

FLOW_METHODS = Registry("flow log-probability method (policy.flow.method)")
TRAINED_MODULES = ("all", "expert")


class FlowSDE:
    """Flow-SDE with hybrid sampling: one stochastic step per sample, ODE steps elsewhere."""

    def __init__(self, flow_cfg):
        self.steps, self.noise_level, self.fixed_step = flow_cfg.steps, flow_cfg.noise_level, flow_cfg.sde_step

    def stochastic_step(self, uniform: torch.Tensor) -> torch.Tensor:
        """``[B]`` step indices: ``policy.flow.sde_step``, or ``floor(uniform * K)``."""
        if self.fixed_step is not None:
            return torch.full_like(uniform, self.fixed_step, dtype=torch.long)
        return (uniform * self.steps).long().clamp(max=self.steps - 1)

    def sample(self, policy: FlowMatchingPolicy, features: torch.Tensor, x0: torch.Tensor, draws: torch.Tensor,
               uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x0 [B, D]``, ``draws [B, K, D]`` -> ``(chain [B, K + 1, D], step [B], log_prob [B, D])``."""
        grid, delta = time_grid(self.steps).to(x0.device), 1.0 / self.steps
        step = self.stochastic_step(uniform).to(x0.device)
        chain, logprob, x = [x0], torch.zeros_like(x0), x0
        for k in range(self.steps):
            t = grid[k].expand(len(x))
            v = policy.velocity(features, x, t)
            mean, std = sde_step(x, v, t[:, None], delta, self.noise_level)
            noisy = mean + std * draws[:, k]
            here = (step == k)[:, None]
            x = torch.where(here, noisy, ode_mean(x, v, delta))
            logprob = torch.where(here, gaussian_logprob(x, mean, std), logprob)
            chain.append(x)
        return torch.stack(chain, 1), step, logprob

    def score(self, policy: FlowMatchingPolicy, features: torch.Tensor, chain: torch.Tensor,
              step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored stochastic step's ``(log_prob [B, D], entropy [B, D])`` under the current weights."""
        rows = torch.arange(len(chain), device=chain.device)
        k = step.long()
        x, after = chain[rows, k], chain[rows, k + 1]
        t = time_grid(self.steps).to(chain.device)[k]
        mean, std = sde_step(x, policy.velocity(features, x, t), t[:, None], 1.0 / self.steps, self.noise_level)
        return gaussian_logprob(after, mean, std), gaussian_entropy(std)


class FlowNoise:
    """Flow-Noise: every step is stochastic, its std from the policy's learned noise head."""

    def __init__(self, flow_cfg):
        self.steps = flow_cfg.steps

    def sample(self, policy: FlowMatchingPolicy, features: torch.Tensor, x0: torch.Tensor, draws: torch.Tensor,
               uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x0 [B, D]``, ``draws [B, K, D]`` -> ``(chain [B, K + 1, D], step [B] = -1, log_prob [B, D])``."""
        grid, delta = time_grid(self.steps).to(x0.device), 1.0 / self.steps
        chain, total, x = [x0], gaussian_logprob(x0, torch.zeros_like(x0), torch.ones_like(x0)), x0
        for k in range(self.steps):
            t = grid[k].expand(len(x))
            mean, std = ode_mean(x, policy.velocity(features, x, t), delta), policy.noise_std(features, x, t)
            x = mean + std * draws[:, k]
            total = total + gaussian_logprob(x, mean, std)
            chain.append(x)
        return torch.stack(chain, 1), torch.full((len(x0),), -1, device=x0.device), total / (self.steps + 1)

    def score(self, policy: FlowMatchingPolicy, features: torch.Tensor, chain: torch.Tensor,
              step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_prob [B, D], entropy [B, D])`` of the stored chain: all ``K`` steps in one batched pass."""
        b, k = len(chain), self.steps
        x = chain[:, :-1].flatten(0, 1)  # [B * K, D]: each step's start
        t = time_grid(k).to(chain.device)[:-1].repeat(b)
        feats = features.repeat_interleave(k, 0)
        mean, std = ode_mean(x, policy.velocity(feats, x, t), 1.0 / k), policy.noise_std(feats, x, t)
        steps = gaussian_logprob(chain[:, 1:].flatten(0, 1), mean, std).unflatten(0, (b, k))
        first = gaussian_logprob(chain[:, 0], torch.zeros_like(chain[:, 0]), torch.ones_like(chain[:, 0]))
        entropy = gaussian_entropy(std).unflatten(0, (b, k)).mean(1)
        return (first + steps.sum(1)) / (k + 1), entropy


FLOW_METHODS.update({"sde": FlowSDE, "noise": FlowNoise})


def time_features(t: torch.Tensor, width: int = 16) -> torch.Tensor:
    """``t [B]`` -> ``[B, width]`` sinusoidal features (frequencies pi * 2^i), as diffusion nets embed time."""
    freqs = math.pi * 2.0 ** torch.arange(width // 2, device=t.device, dtype=t.dtype)
    angles = t[:, None] * freqs
    return torch.cat([rowwise_exact(torch.sin, angles), rowwise_exact(torch.cos, angles)], -1)


class FlowMatchingPolicy(Policy):
    """The chain, its log-probabilities and its decoding; a subclass supplies the networks."""

    chunks = True  # policy.chunk_size actions per decision
    demo_statistics = ("loss",)
    forward_methods = (*Policy.forward_methods, "demo_loss")
    trunk_modules: tuple[str, ...] = ()  # the observation encoder: frozen with policy.flow.train=expert

    def _setup_flow(self, cfg, action_dim: int) -> None:
        """Chunk and chain sizes, the log-probability method and the action statistics from ``cfg``."""
        flow = cfg.flow
        self.action_dim, self.chunk_size, self.width = action_dim, cfg.chunk_size, cfg.chunk_size * action_dim
        self.steps, self.eval_steps = flow.steps, flow.eval_steps or flow.steps
        self.method = FLOW_METHODS.get(flow.method)(flow)
        self.noise_min, self.noise_max = flow.noise_min, flow.noise_max
        self.noise_dim = (self.steps + 1) * self.width + 1
        # normalised actions are [-1, 1]; SFT sets its demos' q01 / q99 (they travel with the weights)
        self.register_buffer("action_stats", ActionStats.identity(action_dim).as_tensor())

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        flow = cfg.flow
        FLOW_METHODS.get(flow.method)
        if flow.train not in TRAINED_MODULES:
            raise UserError(f"policy.flow.train={flow.train}: pick one of {list(TRAINED_MODULES)} (all modules, or "
                            "the flow head alone with the observation encoder frozen).")
        if flow.sde_step is not None and flow.sde_step >= flow.steps:
            raise UserError(f"policy.flow.sde_step={flow.sde_step}, but a chain has policy.flow.steps={flow.steps} "
                            f"steps (0 .. {flow.steps - 1}). Pick one of them, or null to draw one per sample.")
        if flow.noise_min >= flow.noise_max:
            raise UserError(f"policy.flow.noise_min={flow.noise_min} must be below policy.flow.noise_max="
                            f"{flow.noise_max}: they bound Flow-Noise's learned std.")
        return []

    def freeze_trunk(self, train: str) -> None:
        """``policy.flow.train=expert``: the observation encoder keeps its weights."""
        if train == "expert":
            for name in self.trunk_modules:
                getattr(self, name).requires_grad_(False)

    # -- what a subclass provides ------------------------------------------------------
    def heads(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [B, F], value [B])``: the trunk's encoding of the observation, the critic's value."""
        raise NotImplementedError

    def velocity(self, features: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``v [B, D]`` at ``x [B, D]``, times ``t [B]``."""
        raise NotImplementedError

    def noise_std(self, features: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Flow-Noise's std ``[B, D]`` of the step from ``x`` at ``t``, within the configured bounds."""
        raise NotImplementedError

    def scored(self, per_element: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` per number of the chain -> ``[B, chunk_size * A]``, the numbers the env executes, whose
        log-probabilities (and entropy) the update trains on: all of them here (the chain is the chunk)."""
        return per_element

    # -- the policy protocol -------------------------------------------------------------
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.heads(obs)[1]

    def ode_times(self, steps: int) -> torch.Tensor:
        """``[steps + 1]``: the times evaluation's Euler steps visit (a checkpoint's sampler may drift from
        the exact grid: pi0's openpi checkpoints)."""
        return time_grid(steps)

    def ode_chain(self, features: torch.Tensor, x0: torch.Tensor, steps: int) -> torch.Tensor:
        """Plain Euler integration from ``x0 [B, D]``: the chain ``[B, steps + 1, D]``."""
        grid, chain, x = self.ode_times(steps).to(x0.device), [x0], x0
        for k in range(steps):
            x = ode_mean(x, self.velocity(features, x, grid[k].expand(len(x))), 1.0 / steps)
            chain.append(x)
        return torch.stack(chain, 1)

    @staticmethod
    def pack(chain: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """``chain [B, K + 1, D]``, ``step [B]`` -> the stored actions ``[B, (K + 1) * D + 1]``."""
        return torch.cat([chain.flatten(1), step.to(chain.dtype)[:, None]], -1)

    def unpack(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored actions -> ``(chain [B, K + 1, D], step [B])``."""
        return actions[:, :-1].unflatten(-1, (-1, self.width)), actions[:, -1]

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        """``(chain and step [B, (K + 1) * D + 1], log_prob [B, chunk_size * A], value [B])``; deterministic: the
        ODE over ``eval_steps`` (its chain is that long), log-probs zero."""
        features, value = self.heads(obs)
        b = len(value)
        noise = torch.randn(b, self.noise_dim, device=value.device) if noise is None else noise.to(value.device)
        x0 = noise[:, :self.width]
        if deterministic:
            chain = self.ode_chain(features, x0, self.eval_steps)
            return self.pack(chain, torch.full((b,), -1, device=x0.device)), self.scored(torch.zeros_like(x0)), value
        draws = noise[:, self.width:-1].unflatten(-1, (self.steps, self.width))
        uniform = rowwise_exact(torch.special.ndtr, noise[:, -1])
        chain, step, logprob = self.method.sample(self, features, x0, draws, uniform)
        return self.pack(chain, step), self.scored(logprob), value

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """``(log_prob [B, chunk_size * A], entropy [B], value [B])`` of the stored chains under the current
        weights."""
        features, value = self.heads(obs)
        chain, step = self.unpack(actions)
        logprob, entropy = self.method.score(self, features, chain, step)
        return self.scored(logprob), self.scored(entropy).sum(-1), value

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The chain's last point, clipped to [-1, 1] and un-normalised: ``[B, A]``, or ``[B, chunk_size, A]``."""
        x = actions[:, -1 - self.width:-1].clamp(-1.0, 1.0).unflatten(-1, (self.chunk_size, self.action_dim))
        stats = ActionStats.from_tensor(self.action_stats.to(x.device))
        low, high = stats.low.to(x.dtype), stats.high.to(x.dtype)
        scaled = 0.5 * (x + 1) * (high - low + 1e-8) + low
        decoded = torch.where(stats.normalize_mask, scaled, x)
        return decoded if self.chunk_size > 1 else decoded[:, 0]

    def set_action_stats(self, stats: ActionStats) -> None:
        """Normalise actions with ``stats`` from now on (SFT: its demos' q01 / q99)."""
        self.action_stats.copy_(stats.as_tensor())

    def demo_loss(self, obs: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flow-matching loss on demo chunks ``targets [B, chunk_size, A]``: the velocity's mean
        squared error to ``eps - a`` at ``x_t = t * eps + (1 - t) * a``, ``t`` uniform over the
        range the chains visit (``[1 / max(steps, eval_steps), 1]``), ``eps`` standard normal."""
        a = ActionStats.from_tensor(self.action_stats.cpu()).normalize(targets.cpu()).to(targets.device).flatten(1)
        features, _ = self.heads(obs)
        t_min = 1.0 / max(self.steps, self.eval_steps)
        t = t_min + (1.0 - t_min) * torch.rand(len(a), device=a.device)
        eps = torch.randn_like(a)
        v = self.velocity(features, t[:, None] * eps + (1.0 - t[:, None]) * a, t)
        return {"loss": ((v - (eps - a)) ** 2).mean()}
