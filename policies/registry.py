"""Policies registered by name: ``@POLICIES.register("mlp")``; ``make_policy`` builds one."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from envs.common import UserError
from policies.base import POLICIES, changed_settings, require_model_dir
from policies.vla.checkpoint import check_normalization


def resolve_policy_settings(policy_cfg) -> None:
    """Fill, in place, the settings ``policy_cfg`` leaves null ("the checkpoint's", "the family's own": the
    class's ``resolve_settings``), after ``policy.path`` is made ``policy.vla.model_path``. An unknown policy
    name is left for :func:`check_policy_name` to refuse."""
    path, vla = policy_cfg.path, policy_cfg.vla
    if path is not None and vla.model_path is not None and path != vla.model_path:
        raise UserError(f"policy.path={path} and policy.vla.model_path={vla.model_path} name two checkpoints: "
                        "set one (policy.path, as lerobot-eval's --policy.path).")
    known = POLICIES.knows(policy_cfg.name)
    if path is not None and known and "vla" not in POLICIES.get(policy_cfg.name).config_sections:
        raise UserError(f"policy.path={path}: a checkpoint directory is read by the VLA families (openvla, "
                        f"openvla_oft, qwen_vl, pi0); policy={policy_cfg.name} is trained here, and its weights "
                        "load from checkpoint=<run_dir|file.pt>.")
    if path is not None:
        vla.model_path = path
    if known:
        POLICIES.get(policy_cfg.name).resolve_settings(policy_cfg)
    elif policy_cfg.chunk_size is None:
        policy_cfg.chunk_size = 1


def policy_checkpoint_settings(policy_cfg) -> dict[str, dict]:
    """What the policy's checkpoint records of the settings its actions depend on, against the run's values
    (the class's ``checkpoint_settings``): for eval.json's provenance."""
    return POLICIES.get(policy_cfg.name).checkpoint_settings(policy_cfg)


def check_policy_name(name: str) -> None:
    """Raise a UserError if no policy is registered as ``name``."""
    POLICIES.get(name)


def check_policy_config(policy_cfg, action_dim: int | None = None) -> list[str]:
    """Raise a UserError for an unknown policy name or a ``model_path`` that holds no model, and
    whatever the policy class's ``check_config(cfg, action_dim)`` finds (files missing from a
    checkpoint, an ``unnorm_key`` it lacks, statistics of another action size), before any worker starts.
    ``action_dim``: the env's, where known without building it (``envs.registry.env_action_dim``).
    Returns the lines the run log shows about what was chosen (e.g. which statistics normalise actions)."""
    check_policy_name(policy_cfg.name)
    _check_only_its_section_is_set(policy_cfg)
    check_normalization(policy_cfg.vla.normalization)
    if policy_cfg.chunk_size < 1 or (policy_cfg.chunk_size > 1 and not POLICIES.get(policy_cfg.name).chunks):
        raise UserError(f"policy.chunk_size={policy_cfg.chunk_size} is not possible for policy={policy_cfg.name}: "
                        "action chunks (chunk_size > 1) are for VLA policies (openvla, openvla_oft, qwen_vl); "
                        "others take chunk_size=1.")
    if policy_cfg.vla.model_path:
        family = POLICIES.get(policy_cfg.name)
        require_model_dir(policy_cfg.vla.model_path, family.hub_id, family.checkpoint_sources)
    return POLICIES.get(policy_cfg.name).check_config(policy_cfg, action_dim)


def _settings_outside(policy_cfg, sections: tuple[str, ...]) -> list[str]:
    """``policy.<other>.<key>=<value>`` for each key of another family's section set to other than its default."""
    found = []
    for part in fields(policy_cfg):
        value = getattr(policy_cfg, part.name)
        if part.name not in sections and is_dataclass(value):
            found += changed_settings(value, part.name)
    return found


def _check_only_its_section_is_set(policy_cfg) -> None:
    """A UserError for settings in a section the chosen policy does not read (``policy=mlp
    policy.vla.lora_rank=8``): a typo'd family or a forgotten override, never a silent no-op."""
    sections = POLICIES.get(policy_cfg.name).config_sections
    stray = _settings_outside(policy_cfg, sections)
    if stray:
        reads = " and ".join(f"policy.{s}" for s in sections)
        raise UserError(f"{', '.join(stray)}: policy={policy_cfg.name} reads {reads} (and policy.name, "
                        "chunk_size, temperature), not these. Remove them, or pick the policy family they are "
                        "for (policy.net: mlp, cnn, mlp_tokens; policy.vla: openvla, openvla_oft, qwen_vl).")


def check_policy_observations(policy_cfg, obs_spec: dict, action_dim: int) -> None:
    """The policy class's ``check_observations``: what it needs of the env's observations (camera
    keys, a proprio state of the checkpoint's size), in the driver before any policy worker starts."""
    POLICIES.get(policy_cfg.name).check_observations(policy_cfg, obs_spec, action_dim)


def make_policy(policy_cfg, obs_spec: dict, action_dim: int):
    """Build the policy ``policy_cfg.name`` for observations ``obs_spec`` and ``action_dim`` actions."""
    return POLICIES.get(policy_cfg.name)(policy_cfg, obs_spec, action_dim)


def check_trainable(policy_cfg) -> None:
    """Raise a UserError if the policy cannot be trained: ``policy=random``, or a checkpoint whose
    policy class says why not (``untrainable_reason(cfg)``: OFT's L1-regression checkpoints)."""
    name = policy_cfg.name
    check_policy_name(name)
    cls = POLICIES.get(name)
    if not cls.trainable:
        raise UserError(f"policy={name} has nothing to train: it is a baseline for `embodied eval` "
                        "(e.g. `embodied eval env=libero_spatial policy=random`). Train policy=mlp or policy=cnn.")
    reason = cls.untrainable_reason(policy_cfg)
    if reason:
        raise UserError(reason)
