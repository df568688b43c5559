"""What several commands share: the flags of the commands that run a composed config, reading a
checkpoint's config back, where results go, and running the evaluation protocol on fresh workers.

Nothing here imports torch or Ray at module level: ``embodied --help`` and a config error must answer
in the time it takes to compose a config (heavy modules are imported inside the functions that use them).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import OmegaConf

from embodied import run_owner
from embodied.config import (
    TrainConfig,
    compose,
    config_groups,
    group_option,
    to_yaml,
    unknown_group_option_error,
    validate,
)
from embodied.config_files import file_overrides
from embodied.policy_config import upgrade_saved_policy

FORMER_EVAL_EPISODES = 100  # eval.episodes' default in configs saved before null meant "the protocol's count"


def add_overrides(parser: argparse.ArgumentParser, what: str = "") -> None:
    """The positional Hydra overrides every config-running command takes (``what``: the command's own
    special ones, e.g. ``resume=``), so each command's ``--help`` says which it reads."""
    parser.add_argument("overrides", nargs="*", metavar="override",
                        help="Hydra overrides: group=option (env=libero_spatial) or a.b=value (algorithm.lr=1e-4)"
                        + (f"; {what}" if what else ""))


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--cfg job`` and ``--config FILE``: only on commands that run a composed config (a command that
    runs none refuses them as unknown flags, so a user never believes a file was applied)."""
    parser.add_argument("--cfg", choices=["job"], help="print the config this command would run (every key), "
                        "run nothing")
    parser.add_argument("--config", metavar="FILE", help="a YAML file of settings (group options, sections of "
                        "keys), applied before the command line's overrides (which win)")


def config_command(subparsers: argparse._SubParsersAction, name: str, help: str, description: str | None,
                   run: Callable[[argparse.Namespace], int], overrides_help: str = "",
                   flags: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """Declare a command that runs a composed config: ``--cfg`` / ``--config``, the command's own
    ``flags`` (a function that adds them), then the overrides; ``run(args)`` runs it."""
    parser = subparsers.add_parser(name, help=help, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    if flags is not None:
        flags(parser)
    add_overrides(parser, overrides_help)
    parser.set_defaults(run=run)
    return parser


def printed_job_config(args: argparse.Namespace, config: Callable[[], TrainConfig]) -> bool:
    """``--cfg job``: print the config the command would run (``config()``, composed the command's
    way) and say so; the command then stops."""
    if args.cfg != "job":
        return False
    print(to_yaml(config()))
    return True


def composed_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides a config-running command composes: ``--config``'s file first, so the command
    line wins."""
    return [*file_overrides(args.config), *args.overrides] if args.config else list(args.overrides)


def split_override(overrides: list[str], key: str) -> tuple[str | None, list[str]]:
    """Pull ``key=value`` out of the overrides (keys that are not config keys: ``resume``,
    ``checkpoint``); an empty value counts as not given."""
    value, rest = None, []
    for item in overrides:
        if item.startswith(f"{key}="):
            value = item.split("=", 1)[1] or None
        else:
            rest.append(item)
    return value, rest


def config_from_saved(saved_yaml: str, overrides: list[str]) -> TrainConfig:
    """A run's saved config with command-line overrides on top.

    ``group=option`` replaces that section by ``configs/<group>/<option>.yaml``;
    ``a.b=value`` sets one key. Unknown keys are UserErrors, as for ``train``.
    """
    base = upgrade_saved_policy(OmegaConf.create(saved_yaml))
    if OmegaConf.select(base, "eval.episodes") == FORMER_EVAL_EPISODES:
        base.eval.episodes = None  # the former default, which a suite ignored: not a setting anybody made
    groups = config_groups()
    dotted = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in groups:
            if value not in groups[key]:
                raise unknown_group_option_error(key, value)
            sections = group_option(key, value)
            base[key] = sections.pop(key)  # the group's own section is replaced; others take its settings
            for section, settings in sections.items():
                base[section] = OmegaConf.merge(base[section], settings)
        else:
            dotted.append(item)
    return validate(OmegaConf.merge(base, OmegaConf.from_dotlist(dotted)))


@contextlib.contextmanager
def removed_if_failed_empty(path: Path) -> Iterator[None]:
    """A command that fails before writing anything into ``path`` leaves no directory behind."""
    try:
        yield
    except BaseException:
        run_owner.release(path)  # its owner file goes, and the directory if this command made it
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise


def checkpointed(overrides: list[str]) -> tuple[TrainConfig, dict | None, Path | None]:
    """(config, checkpoint state or None, checkpoint path or None) for eval / record / a warm start:
    with ``checkpoint=``, the checkpoint's own config (the env and policy it was trained with) under
    the other overrides, since composing the defaults would evaluate a different policy."""
    from embodied.checkpoint import load_checkpoint, resolve_checkpoint

    ckpt, rest = split_override(overrides, "checkpoint")
    if ckpt is None:
        return compose(rest), None, None
    path = resolve_checkpoint(ckpt)
    state = load_checkpoint(path)
    cfg = config_from_saved(state["config_yaml"], rest)
    named_here, _ = split_override(rest, "runner.run_dir")
    if named_here is None:  # where the checkpoint's run wrote is not where this command writes
        cfg.runner.run_dir = None
    return cfg, state, path


def out_dir(cfg: TrainConfig, ckpt_path: Path | None, kind: str, name: str) -> Path:
    """Where ``eval`` / ``record`` write: ``runner.run_dir`` (refused if it holds results), else a new
    ``<run>/<kind>/<name>-<time>`` beside the checkpoint's run, else ``runs/<kind>-<task>-<policy>-<time>``."""
    from embodied.run_dirs import claim_dir, make_unique_dir, run_of_checkpoint, stamp

    if cfg.runner.run_dir:
        return claim_dir(cfg.runner.run_dir, Path("runs"), kind, f"this {kind}")
    run = run_of_checkpoint(ckpt_path) if ckpt_path is not None else None
    if run is not None:
        return make_unique_dir(run / kind, f"{name}-{stamp()}")
    return make_unique_dir(Path("runs"), f"{kind}-{cfg.env.task}-{cfg.policy.name}-{stamp()}")


def run_protocol(cfg: TrainConfig, actor_state: dict | None, seeds: list[int],
                 record: set[int] = frozenset()) -> tuple[list[dict], list, int]:
    """Evaluate ``actor_state`` (None: the policy as built) on ``seeds`` with fresh workers.
    Returns ``(rows, videos, simulator steps run)`` (padding episodes and whole chunks included).

    An evaluation depends only on its seeds and the weights, so one that a worker fault broke is
    simply redone on replaced workers, under the trainer's restart budget (``runner.max_worker_restarts``
    within ``runner.restart_window_minutes``; embodied/recovery.py)."""
    from embodied.recovery import FaultLog, Recovery
    from embodied.runner import start_workers

    workers = start_workers(cfg)

    def evaluate() -> tuple[list[dict], dict]:  # loads the weights every try: a replaced actor has its initial ones
        if actor_state is not None:
            workers.load_actor_state(actor_state, weights_only=True)
        return workers.evaluate(seeds, cfg.eval.deterministic, record, progress=cfg.runner.progress)

    recovery = Recovery(workers, FaultLog(cfg.runner), note=lambda line: print(f"note: {line}", file=sys.stderr),
                        restore_actor=lambda: (0, "replaced; the evaluated weights are loaded on the next try"))
    try:
        done, result = False, None
        while not done:
            done, result = recovery.guarded(evaluate)
        rows, videos = result
        layout = workers.layout
        return rows, videos, layout.env_steps(workers.max_episode_steps) * len(layout.evaluation_rounds(len(seeds)))
    finally:
        workers.shutdown()
