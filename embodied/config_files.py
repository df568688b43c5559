"""A user's config file (``embodied <command> --config my.yaml``) turned into Hydra overrides."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from embodied.config import config_groups
from envs.common import UserError

TOP_LEVEL_PATHS = ("checkpoint", "resume")  # TrainConfig's keys outside a section, read as the command line's


def file_overrides(path: str | Path) -> list[str]:
    """A user's config file (``embodied <command> --config my.yaml``) as overrides, to go before the
    command line's, which win. Top-level ``group: option`` picks a group's option (``env: libero_spatial``),
    as does a Hydra-style ``defaults: [{env: libero_spatial}, ...]`` list, which lets the file also set keys
    of that section; a section's mapping sets its keys (``placement: {mode: hybrid, env: 0-1}``);
    ``checkpoint`` and ``resume`` as on the command line. ``embodied <command> --cfg job`` prints what it
    composes to."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--config {path}: no such file. Pass a YAML file of settings (e.g. `env: libero_spatial` "
                        "and `placement: {mode: hybrid}`); `embodied train --cfg job` prints every key.")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(file))
    except Exception as err:  # a YAML syntax error, reported by line
        raise UserError(f"--config {path} is not valid YAML: {str(err).splitlines()[0]}. Fix the file.") from None
    if not isinstance(raw, dict):
        raise UserError(f"--config {path} holds a {type(raw).__name__}, not a mapping of settings: write "
                        "`section: {key: value}` or `group: option` lines.")
    groups = config_groups()
    overrides = _defaults_list(raw.pop("defaults", []), groups, path)
    for key, value in raw.items():
        if key in TOP_LEVEL_PATHS or (key in groups and isinstance(value, str)):
            overrides.append(f"{key}={value}")  # a path or an option name, unquoted as typed
        elif isinstance(value, dict):
            overrides += [f"{dotted}={_override_value(v)}" for dotted, v in _flatten(value, str(key))]
        else:
            raise UserError(f"--config {path}: top-level `{key}: {value}` is neither a group option "
                            f"({', '.join(groups)}: a name from configs/<group>/) nor a section of keys. Write it "
                            "as `section: {key: value}`.")
    return overrides


def _defaults_list(choices, groups: dict[str, list[str]], path) -> list[str]:
    """``defaults: [{env: libero_10}, {policy: openvla_tiny}]`` -> ``["env=libero_10", "policy=openvla_tiny"]``."""
    def is_choice(entry) -> bool:
        return isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in groups

    if not isinstance(choices, list) or not all(is_choice(entry) for entry in choices):
        raise UserError(f"--config {path}: `defaults:` must be a list of `{{group: option}}` entries, groups being "
                        f"{', '.join(groups)} (e.g. `defaults: [{{env: libero_10}}, {{algorithm: grpo}}]`).")
    return [f"{group}={option}" for entry in choices for group, option in entry.items()]


def _flatten(section: dict, prefix: str) -> list[tuple[str, object]]:
    items = []
    for key, value in section.items():
        dotted = f"{prefix}.{key}"
        items += _flatten(value, dotted) if isinstance(value, dict) else [(dotted, value)]
    return items


def _override_value(value) -> str:
    """A YAML value in Hydra's override syntax (strings quoted, so ``0-1`` or ``null`` stay strings)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    text = str(value)
    return f"'{text}'" if "'" not in text else f'"{text}"'
