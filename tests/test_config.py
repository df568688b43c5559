"""Defaults are written once: embodied/config.py's dataclasses are the default run, and each
yaml option holds only how it differs from them."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from embodied.config import CONFIG_DIR, TrainConfig, compose, config_groups

OPTIONS = [(group, option) for group, options in sorted(config_groups().items()) for option in options]


def test_the_default_run_is_the_dataclass_defaults():
    assert compose([]) == TrainConfig()


def test_train_yaml_only_picks_the_group_options():
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml"))
    extra = sorted(set(raw) - {"defaults"})
    assert not extra, f"train.yaml sets {extra}: defaults belong in embodied/config.py"


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_a_group_option_only_holds_its_differences_from_the_defaults(group, option):
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml"))
    defaults = dataclasses.asdict(getattr(TrainConfig(), group))
    unknown = sorted(set(raw) - set(defaults))
    assert not unknown, f"{group}/{option}.yaml sets keys the schema lacks: {unknown}"
    same = sorted(k for k, v in raw.items() if v == defaults[k])
    assert not same, f"{group}/{option}.yaml repeats the defaults of {same}: drop them (embodied/config.py has them)"
