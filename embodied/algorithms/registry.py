"""The algorithms by name (``algorithm.name``): :func:`make_algorithm` builds the run's one
:class:`~embodied.algorithms.base.Algorithm`. A new algorithm's module is imported here, once."""

from __future__ import annotations

from embodied.algorithms import grpo, ppo, sac  # noqa: F401  (each module registers its algorithm)
from embodied.algorithms.base import ALGORITHMS, Algorithm


def make_algorithm(cfg) -> Algorithm:
    """The algorithm ``cfg.algorithm.name`` names (``cfg``: an ``AlgorithmConfig``), built on
    ``cfg``; an unknown name is a UserError that lists the registered ones."""
    return ALGORITHMS.get(cfg.name)(cfg)
