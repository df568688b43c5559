"""Policies registered by name: ``@register_policy("mlp")``; ``make_policy`` builds one."""

from __future__ import annotations

from collections.abc import Callable

POLICIES: dict[str, Callable] = {}


def register_policy(name: str) -> Callable:
    def decorator(cls):
        POLICIES[name] = cls
        return cls

    return decorator


def check_policy_name(name: str) -> None:
    """Raise a UserError if no policy is registered as ``name``."""
    import policies.cnn  # noqa: F401  (registers)
    import policies.mlp  # noqa: F401

    if name not in POLICIES:
        from embodied.errors import unknown_name_error

        raise unknown_name_error("policy (policy.name / policy=...)", name, list(POLICIES))


def make_policy(policy_cfg, obs_spec: dict, action_dim: int):
    """Build the policy ``policy_cfg.name`` for observations ``obs_spec`` and ``action_dim`` actions."""
    check_policy_name(policy_cfg.name)
    return POLICIES[policy_cfg.name](policy_cfg, obs_spec, action_dim)
