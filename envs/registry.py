"""Env backends registered by name: ``@register_env("maniskill")``.

A backend is a function ``make(env_cfg, num_envs, num_procs)``
returning a :class:`~envs.base.VecEnv`. Backends register when their module is
imported; :func:`make_vec_env` imports them lazily so that, say, LIBERO's heavy
imports are paid only by runs that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from embodied.registry import Registry

ENV_BACKENDS: dict[str, Callable] = {}
ENV_VALIDATORS: dict[str, Callable] = {}

# backend name -> module that registers it
_BACKEND_MODULES = Registry("env backend (env.backend)")
_BACKEND_MODULES.update({"maniskill": "envs.maniskill", "libero": "envs.libero"})


def register_env(name: str, validate: Callable | None = None) -> Callable:
    """Register a backend; ``validate(env_cfg)`` raises UserError for bad names before any sim starts."""

    def decorator(fn: Callable) -> Callable:
        ENV_BACKENDS[name] = fn
        if validate is not None:
            ENV_VALIDATORS[name] = validate
        return fn

    return decorator


def _load_backend(env_cfg) -> None:
    importlib.import_module(_BACKEND_MODULES.get(env_cfg.backend))


def check_env_config(env_cfg) -> None:
    """Raise a UserError if ``env_cfg`` names an unknown backend or task."""
    _load_backend(env_cfg)
    if env_cfg.backend in ENV_VALIDATORS:
        ENV_VALIDATORS[env_cfg.backend](env_cfg)


def make_vec_env(env_cfg, num_envs: int | None = None, num_procs: int | None = None):
    """Build the VecEnv that ``env_cfg`` describes.

    ``num_envs`` / ``num_procs`` default to ``env_cfg.num_envs`` / ``env_cfg.num_procs``.
    """
    check_env_config(env_cfg)
    return ENV_BACKENDS[env_cfg.backend](
        env_cfg,
        num_envs=env_cfg.num_envs if num_envs is None else num_envs,
        num_procs=env_cfg.num_procs if num_procs is None else num_procs,
    )
