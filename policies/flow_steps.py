"""One denoising step of a flow-matching action head: the ODE step, the Flow-SDE step and their
Gaussian log-densities, in openpi's time convention.

Time runs from ``t = 1`` (noise) to ``t = 0`` (the action): ``x_t = t * eps + (1 - t) * a``, so
the velocity the network predicts is ``v = dx/dt = eps - a``. ``K`` steps walk the grid
``t_k = 1 - k / K`` (:func:`time_grid`) with ``delta = 1 / K``; from ``x_t`` and ``v`` the
network's guesses of the clean action and of the noise are ``x0_hat = x_t - t * v`` and
``x1_hat = x_t + (1 - t) * v``.

- ODE (Euler): ``x_{t - delta} = x_t - delta * v`` (:func:`ode_mean`), no noise.
- Flow-SDE (pi_RL, arXiv 2510.25889, after Flow-GRPO arXiv 2505.05470): the SDE with the ODE's
  marginals, discretised: ``sigma_t = a * sqrt(t / (1 - t))`` (``a``: the noise level; the
  ``t = 1`` step, where it is infinite, takes the next grid point's), mean
  ``(1 - (t - delta)) * x0_hat + (t - delta - sigma_t^2 * delta / (2 t)) * x1_hat`` and std
  ``sqrt(delta) * sigma_t`` (:func:`sde_step`). With ``a = 0`` the mean is the ODE's.

Every function works elementwise on tensors of any shape; ``t`` broadcasts against ``x``.
"""

from __future__ import annotations

import math

import torch

from policies.base import rowwise_exact

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def time_grid(steps: int) -> torch.Tensor:
    """``[steps + 1]``: ``t_k = 1 - k / steps``, from 1 (noise) to 0 (the action), each computed in float64 as
    ``1 + k * (-1 / steps)`` and then cast to float32, as lerobot's and openpi's PyTorch samplers make them (in
    float32 ``1 - k / steps`` is one ulp off theirs for 3, 5, 6, 7, 9, 10, ... steps)."""
    dt = -1.0 / steps
    return torch.tensor([1.0 + k * dt for k in range(steps)] + [0.0], dtype=torch.float64).float()


def accumulated_time_grid(steps: int) -> torch.Tensor:
    """``[steps + 1]`` from 1 to about 0 as openpi's sampler visits them: ``t += -1 / steps`` in float32, which
    drifts from :func:`time_grid` by up to one float32 step (0.79999995 for 0.8)."""
    t, dt, grid = torch.tensor(1.0), torch.tensor(-1.0 / steps), [torch.tensor(1.0)]
    for _ in range(steps):
        t = t + dt
        grid.append(t)
    return torch.stack(grid)


def ode_mean(x: torch.Tensor, v: torch.Tensor, delta: float) -> torch.Tensor:
    """The Euler step from ``t`` to ``t - delta``: ``x - delta * v``."""
    return x - delta * v


def sde_sigma(t: torch.Tensor, delta: float, noise_level: float) -> torch.Tensor:
    """``a * sqrt(t / (1 - t))``, at ``t - delta`` where ``t = 1`` (where it is infinite)."""
    at = torch.where(t >= 1.0, t - delta, t)
    return noise_level * torch.sqrt(at / (1.0 - at))


def sde_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, delta: float,
             noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Flow-SDE transition from ``t`` to ``t - delta``: ``(mean, std)``, each of ``x``'s shape."""
    sigma = sde_sigma(t, delta, noise_level)
    x0_hat, x1_hat = x - t * v, x + (1.0 - t) * v
    after = t - delta
    mean = (1.0 - after) * x0_hat + (after - sigma**2 * delta / (2.0 * t)) * x1_hat
    return mean, (math.sqrt(delta) * sigma).expand_as(mean)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The elementwise log-density of ``x`` under ``N(mean, std^2)``."""
    return -0.5 * ((x - mean) / std) ** 2 - rowwise_exact(torch.log, std) - LOG_SQRT_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """The elementwise entropy of ``N(., std^2)``: ``log std + 0.5 log(2 pi e)``."""
    return rowwise_exact(torch.log, std) + LOG_SQRT_2PI + 0.5
