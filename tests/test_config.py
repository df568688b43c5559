"""Defaults are written once: embodied/config.py's dataclasses are the default run, and each
yaml option holds only how it differs from them."""

from __future__ import annotations

import dataclasses
import re

import pytest
from omegaconf import OmegaConf

from embodied.config import (
    CONFIG_DIR,
    TrainConfig,
    compose,
    config_groups,
    group_option,
    group_option_parent,
    validate,
)
from envs.common import UserError
from policies.registry import check_policy_config, resolve_policy_settings
from tests.conftest import REPO

OPTIONS = [(group, option) for group, options in sorted(config_groups().items()) for option in options]


def test_the_default_run_is_the_dataclass_defaults():
    defaults = TrainConfig()
    resolve_policy_settings(defaults.policy)  # what the schema leaves null ("the policy's own") gets its value
    assert compose([]) == defaults and defaults.policy.chunk_size == 1


def test_a_config_saved_before_keys_became_null_is_still_a_valid_mlp_run():
    """Configs saved when ``policy.vla.dtype`` / ``image_size`` defaulted to float32 / 64 (the shipped warm start's,
    old runs') carry those values in a section mlp does not read: not settings anybody made."""
    raw = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    raw["policy"]["vla"].update(dtype="float32", image_size=64)
    check_policy_config(validate(raw).policy, 4)
    raw["policy"]["vla"].update(image_size=32)
    with pytest.raises(UserError, match="policy.vla.image_size=32: policy=mlp reads policy.net"):
        check_policy_config(validate(raw).policy, 4)


def test_a_checkpoints_settings_fill_what_the_config_leaves_null_and_an_override_wins(tmp_path):
    """pi0's executed actions, Euler steps, image size and prompt length are the checkpoint's config.json's
    unless the command line sets them; ``policy.path`` is ``policy.vla.model_path``."""
    ckpt = CONFIG_DIR.parent / "assets" / "reference" / "pi05_tiny_1cam"
    policy = compose(["policy=pi05_tiny", f"policy.path={ckpt}"]).policy
    assert (policy.vla.model_path, policy.chunk_size, policy.flow.eval_steps, policy.pi.image_size,
            policy.pi.max_tokens) == (str(ckpt), 10, 10, 224, 64)  # its config.json's
    policy = compose(["policy=pi05_tiny", f"policy.path={ckpt}", "policy.chunk_size=3", "policy.flow.eval_steps=4"]
                     ).policy
    assert (policy.chunk_size, policy.flow.eval_steps) == (3, 4)
    assert compose(["policy=pi05_tiny"]).policy.chunk_size == 4  # a tiny network from scratch
    oft = CONFIG_DIR.parent / "assets" / "reference" / "openvla_oft_l1_tiny"
    vla = compose(["policy=openvla_oft_tiny", f"policy.path={oft}"]).policy.vla
    assert (vla.model_path, vla.image_size) == (str(oft), 224)  # its config.json's image_sizes (the tiny: 64)
    with pytest.raises(UserError, match="policy=mlp is trained here, and its weights load from checkpoint="):
        compose(["policy=mlp", f"policy.path={oft}"])
    with pytest.raises(UserError, match="name two checkpoints"):
        compose(["policy=pi05_tiny", f"policy.path={ckpt}", f"policy.vla.model_path={tmp_path}"])


def test_train_yaml_only_picks_the_group_options():
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml"))
    extra = sorted(set(raw) - {"defaults"})
    assert not extra, f"train.yaml sets {extra}: defaults belong in embodied/config.py"


def _unknown_and_repeated(raw: dict, defaults: dict, where: str) -> tuple[list[str], list[str]]:
    """Keys of ``raw`` the schema lacks, and keys set to their default, in nested sections too (``policy.vla``)."""
    unknown = [f"{where}.{k}" for k in raw if k not in defaults]
    same = [f"{where}.{k}" for k, v in raw.items() if k in defaults and not isinstance(v, dict) and v == defaults[k]]
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            more_unknown, more_same = _unknown_and_repeated(value, defaults[key], f"{where}.{key}")
            unknown, same = unknown + more_unknown, same + more_same
    return unknown, same


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_a_group_option_only_holds_its_differences_from_the_defaults(group, option):
    """Of every section it sets (a ``_global_`` policy config also sets the env its checkpoint needs); an option
    that extends another (pi0_3b_libero_rl: pi0_3b_libero_openpi) holds only how it differs from that one."""
    sections = group_option(group, option, inherited=False)
    assert group in sections, f"{group}/{option}.yaml does not set its own section"
    parent = group_option_parent(group, option)
    baseline = compose([f"{group}={parent}"]) if parent else TrainConfig()
    for section, settings in sections.items():
        raw = OmegaConf.to_container(settings)
        unknown, same = _unknown_and_repeated(raw, dataclasses.asdict(getattr(baseline, section)), section)
        assert not unknown, f"{group}/{option}.yaml sets keys the schema lacks: {unknown}"
        assert not same, (f"{group}/{option}.yaml repeats the defaults of {same}: drop them "
                          f"({parent or 'embodied/config.py and embodied/policy_config.py'} has them)")


def _numeric_keys(schema=TrainConfig, prefix: str = "") -> list[tuple[str, object]]:
    """Every int / float key of the schema as (dotted key, its Range or None), in nested sections too."""
    keys = []
    for key in dataclasses.fields(schema):
        if key.name in ("checkpoint", "resume"):
            continue
        if key.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(key.default_factory()):
            keys += _numeric_keys(type(key.default_factory()), f"{prefix}{key.name}.")
        elif key.type.split(" |")[0] in ("int", "float"):
            keys.append((f"{prefix}{key.name}", key.metadata.get("range")))
    return keys


def test_every_numeric_key_declares_its_range():
    """A new numeric key must say which values it takes (``ranged`` in embodied/config.py)."""
    assert [key for key, allowed in _numeric_keys() if allowed is None] == []


@pytest.mark.parametrize("key, allowed", [(k, r) for k, r in _numeric_keys() if r and (r.low, r.high) != (None, None)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_numeric_key_outside_its_range_is_refused_and_its_bounds_are_not(key, allowed):
    """On the default config with one key changed (``compose`` runs the same ``check_ranges``: the
    CLI cases in tests/test_cli_errors.py go through it)."""
    from embodied.config_ranges import check_ranges

    def with_value(value) -> TrainConfig:
        cfg = TrainConfig()
        *sections, name = key.split(".")
        part = cfg
        for section in sections:
            part = getattr(part, section)
        setattr(part, name, value)
        return cfg

    if allowed.low is not None:
        with pytest.raises(UserError, match=f"{key}=.* is out of range: it must be") as refused:
            check_ranges(with_value(allowed.low if allowed.above else allowed.low - 1))
        # it names the one file that declares the key, and that file does
        named = re.search(r"in (\S+\.py) says what it means", str(refused.value)).group(1)
        assert re.search(rf"^    {key.rsplit('.', 1)[-1]}: ", (REPO / named).read_text(), re.M), named
        check_ranges(with_value(allowed.low + 0.5 if allowed.above else allowed.low))  # the smallest allowed
    if allowed.high is not None:
        with pytest.raises(UserError, match=f"{key}=.* is out of range"):
            check_ranges(with_value(allowed.high + 1))
        check_ranges(with_value(allowed.high))


def test_a_config_file_picks_options_and_sets_keys_and_the_command_line_wins(tmp_path):
    """``embodied <command> --config my.yaml``: the file's settings, then the command line's overrides."""
    from embodied.config_files import file_overrides

    mine = tmp_path / "my.yaml"
    mine.write_text("env: maniskill_pushcube_rgb\npolicy: cnn\n"
                    "placement: {mode: hybrid, env: '1', rollout: '0', actor: '0'}\n"
                    "algorithm: {lr: 1.0e-4, rollout_steps: null, update_epochs: 3}\n"
                    "eval: {tasks: null}\nrunner: {run_dir: runs/my run}\n")
    cfg = compose([*file_overrides(mine), "algorithm.lr=2e-4", "policy=mlp"])
    assert (cfg.env.obs_mode, cfg.policy.name) == ("rgb", "mlp")  # the file's env, the command line's policy
    assert (cfg.placement.mode, cfg.placement.env, cfg.placement.rollout) == ("hybrid", "1", "0")
    assert (cfg.algorithm.lr, cfg.algorithm.rollout_steps, cfg.algorithm.update_epochs) == (2e-4, None, 3)
    assert cfg.runner.run_dir == "runs/my run"


def test_a_config_file_may_pick_options_in_a_defaults_list_and_set_keys_of_the_same_sections(tmp_path):
    from embodied.config_files import file_overrides

    mine = tmp_path / "my.yaml"
    mine.write_text("defaults: [{env: libero_10}, {algorithm: grpo}]\nenv: {num_envs: 16}\nalgorithm: {lr: 1.0e-5}\n")
    cfg = compose(file_overrides(mine))
    assert (cfg.env.task, cfg.env.num_envs) == ("libero_10", 16)
    assert (cfg.algorithm.advantage, cfg.algorithm.lr) == ("grpo", 1e-5)
    mine.write_text("defaults: [{envv: libero_10}]\n")
    with pytest.raises(UserError, match="defaults"):
        file_overrides(mine)


@pytest.mark.parametrize(("wrong", "meant"), [
    ("sac.buffer_size", "'algorithm.sac.buffer_size'"),  # a section left out
    ("algorithm.buffer_size", "'algorithm.sac.buffer_size'"),  # a nested section left out
    ("algorithm.lrr", "'algorithm.lr'"),  # misspelled
    ("evl.episodes", "'eval.episodes'"),  # a misspelled section, the rest right
    ("policy.vla.modle_path", "'policy.vla.model_path'"),
    ("lr", "'algorithm.lr' or 'sft.lr'"),  # two keys end so: both
])
def test_an_unknown_key_suggests_the_nearest_key_however_deep(wrong, meant):
    with pytest.raises(UserError, match=f"Unknown config key '{re.escape(wrong)}'. Did you mean {re.escape(meant)}\\?"):
        compose([f"{wrong}=1"])


# keys that were constants in the code (issue 37): today's value as the default, set from the command line,
# refused out of range (with the range test above, which covers every numeric key)
FORMER_CONSTANTS = [
    ("env.startup_timeout_s", 300.0, "600", "0"),
    ("runner.probe_every_s", 5.0, "1.5", "0"),
    ("runner.ping_timeout_s", 10.0, "3", "0"),
    ("runner.recovery_settle_s", 30.0, "5", "-1"),
    ("runner.solved_success", 0.9, "0.75", "1.5"),
    ("runner.keep_checkpoints", 3, "1", "0"),
    ("placement.fsdp_from_parameters", 100_000_000, "1000000", "-1"),
]


@pytest.mark.parametrize(("key", "default", "value", "bad"), FORMER_CONSTANTS, ids=[k[0] for k in FORMER_CONSTANTS])
def test_a_former_constant_is_a_key_with_its_old_default(key, default, value, bad):
    section, name = key.split(".")
    assert getattr(getattr(TrainConfig(), section), name) == default
    assert getattr(getattr(compose([f"{key}={value}"]), section), name) == pytest.approx(float(value))
    with pytest.raises(UserError, match=f"{key}={bad}.* is out of range"):
        compose([f"{key}={bad}"])


# the policy section: shared keys, then one section per family (embodied/policy_config.py)
def test_a_policy_key_in_its_former_flat_place_is_refused_naming_its_section():
    with pytest.raises(UserError, match=r"'policy.model_path' is now 'policy.vla.model_path'"):
        compose(["policy.model_path=checkpoints/x"])
    with pytest.raises(UserError, match=r"'policy.hidden_sizes' is now 'policy.net.hidden_sizes'"):
        compose(["policy.hidden_sizes=[64]"])
    assert compose(["policy.net.hidden_sizes=[64]"]).policy.net.hidden_sizes == [64]


def test_a_config_saved_with_flat_policy_keys_loads_into_the_sections(tmp_path):
    """Run directories and checkpoints written before the sections still evaluate and resume."""
    from embodied.commands.common import config_from_saved
    from embodied.config import load_yaml

    flat = OmegaConf.to_container(OmegaConf.structured(TrainConfig()))
    flat["policy"] = {"name": "openvla", "chunk_size": 2, "model_path": "checkpoints/x", "lora_rank": 4,
                      "hidden_sizes": [32]}
    saved = OmegaConf.to_yaml(OmegaConf.create(flat))
    cfg = config_from_saved(saved, ["policy.vla.dtype=bfloat16"])
    assert (cfg.policy.name, cfg.policy.chunk_size) == ("openvla", 2)
    vla = cfg.policy.vla
    assert (vla.model_path, vla.lora_rank, vla.dtype) == ("checkpoints/x", 4, "bfloat16")
    assert cfg.policy.net.hidden_sizes == [32]
    (tmp_path / "config.yaml").write_text(saved)
    assert load_yaml(tmp_path / "config.yaml").policy.vla.model_path == "checkpoints/x"


@pytest.mark.parametrize("overrides, stray", [
    (["policy=mlp", "policy.vla.lora_rank=8"], "policy.vla.lora_rank=8"),
    (["policy=openvla_tiny", "policy.net.hidden_sizes=[64]"], "policy.net.hidden_sizes=[64]"),
])
def test_a_key_of_another_familys_section_is_refused(overrides, stray):
    from policies.registry import check_policy_config

    with pytest.raises(UserError, match=rf"{re.escape(stray)}: policy=\w+ reads policy\.(net|vla)"):
        check_policy_config(compose(overrides).policy)


def test_each_family_reads_its_own_section():
    from policies.base import POLICIES

    sections = {name: POLICIES.get(name).config_sections for name in POLICIES.names()}
    assert {n for n, s in sections.items() if "vla" in s} == {"openvla", "openvla_oft", "qwen_vl", "pi0"}
    assert {n for n, s in sections.items() if "pi" in s} == {"pi0"}
    assert {s for names in sections.values() for s in names} == {"net", "vla", "flow", "pi"}


def test_an_option_that_extends_another_brings_its_settings_to_a_saved_run():
    """``embodied eval checkpoint=... policy=pi0_3b_libero_lora``: the option's own keys on top of the options it
    extends (pi0_3b_libero_rl, pi0_3b_libero_openpi), as Hydra composes them for ``train``."""
    from embodied.commands.common import config_from_saved

    saved = OmegaConf.to_yaml(OmegaConf.structured(TrainConfig()))
    cfg = config_from_saved(saved, ["policy=pi0_3b_libero_lora"])
    assert cfg == compose(["policy=pi0_3b_libero_lora"])
    assert cfg.policy.vla.lora_rank == 32 and cfg.policy.pi.delta_actions == 6 and cfg.env.image_size == 256

