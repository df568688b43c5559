"""``embodied chaos [overrides] --faults 10``: train while a :class:`~embodied.chaos.ChaosMonkey`
kills and stops workers on a seeded schedule, then report what the run survived (chaos.json,
chaos.md in the run directory). ``--reference`` also trains the same config without faults and
compares the final evaluations.

The training is ``embodied train``'s own (:func:`embodied.commands.train.train_once`), with the
monkey running alongside it: a chaos run is a training run, so what it proves holds for ``train``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from embodied.chaos import (
    GROUP_OF,
    STOP_SHARES,
    TARGETS,
    ChaosMonkey,
    Injection,
    compare,
    cpu_contention,
    draw_schedule,
    markdown,
    report,
)
from embodied.commands.common import (
    composed_overrides,
    config_command,
    printed_job_config,
)
from embodied.commands.train import prepare, train_once
from embodied.config import compose
from envs.common import UserError

if TYPE_CHECKING:
    from embodied.trainer import Trainer

HELP = "train while killing / stopping workers on a seeded schedule; report what the run survived"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``chaos``: train's flags and overrides, plus the fault schedule's."""
    config_command(subparsers, "chaos", HELP, __doc__, run, "as for `embodied train`", flags=_schedule_flags)


def _schedule_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", type=int, default=10, metavar="N", help="worker faults to inject (default: 10)")
    parser.add_argument("--chaos-seed", type=int, default=0, metavar="S",
                        help="seed of the fault schedule (default: 0)")
    parser.add_argument("--targets", default="env,rollout,actor", metavar="LIST",
                        help=f"which processes to signal, comma-separated: some of {', '.join(TARGETS)} "
                        "(simulator: the sim processes of env workers, with env.num_procs > 0)")
    parser.add_argument("--signal", choices=sorted(STOP_SHARES), default="mixed",
                        help="which signal the injections send: mixed (a quarter SIGSTOP, a hang; the rest SIGKILL), "
                        "kill or stop (default: mixed)")
    parser.add_argument("--busy-loops", type=int, default=0, metavar="N",
                        help="run N busy loops (`while True: pass`) beside the training, once its workers are up and "
                        "until its final evaluation ends: faults under CPU contention (default: 0)")
    parser.add_argument("--reference", action="store_true",
                        help="also train without faults (into <run_dir>/reference) and compare the final evaluations")


def run(args: argparse.Namespace) -> int:
    """Train under the schedule; write and print the report; the run directory is the last line."""
    overrides = composed_overrides(args)
    if printed_job_config(args, lambda: compose(overrides)):
        return 0
    chaos = Chaos(args.faults, args.chaos_seed, parse_targets(args.targets), STOP_SHARES[args.signal],
                  max(0, args.busy_loops))
    run_dir, summary = train_once(prepare(overrides), alongside=chaos.injecting)
    result = report(chaos.monkey.fired, chaos.schedule, summary["faults"], chaos.monkey.missed)
    if args.reference:
        result["reference"] = _compare_with_reference(overrides, run_dir, summary)
    (run_dir / "chaos.json").write_text(json.dumps(result, indent=1))
    (run_dir / "chaos.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    print(run_dir.resolve())
    return 0


def parse_targets(targets: str) -> tuple[str, ...]:
    """``--targets env,rollout``: the names, refused (a UserError, exit 2) unless each is a target."""
    chosen = tuple(t.strip() for t in targets.split(",") if t.strip())
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown or not chosen:
        raise UserError(f"--targets {targets!r}: name some of {', '.join(TARGETS)}, comma-separated "
                        "(simulator: the sim processes of env workers, with env.num_procs > 0).")
    return chosen


@dataclass
class Chaos:
    """How many faults, drawn with which seed, into which targets; once training starts, the drawn
    schedule and the monkey firing it (its record of what fired feeds the report)."""

    faults: int
    seed: int
    targets: tuple[str, ...]
    stop_share: float = STOP_SHARES["mixed"]  # of the injections, those that SIGSTOP (a hang)
    busy_loops: int = 0  # busy loops beside the training (CPU contention)
    schedule: list[Injection] = field(default_factory=list)
    monkey: ChaosMonkey | None = None

    @contextlib.contextmanager
    def injecting(self, trainer: Trainer) -> Iterator[ChaosMonkey]:
        """Fire the schedule into ``trainer`` while the block runs; stop firing when it ends, however."""
        self.schedule = draw_schedule(self.seed, self.faults, trainer.total_iterations, self.targets,
                                      stop_share=self.stop_share)
        per_group = Counter(GROUP_OF[i.target] for i in self.schedule)
        limit = trainer.cfg.runner.max_worker_restarts
        if max(per_group.values(), default=0) > limit:
            print(f"note: the schedule restarts a group up to {max(per_group.values())} times "
                  f"({dict(per_group)}; simulator faults restart env workers), beyond runner.max_worker_restarts="
                  f"{limit}: the run will stop there unless you raise it", file=sys.stderr)
        self.monkey = ChaosMonkey(trainer, self.schedule)
        with cpu_contention(self.busy_loops):
            self.monkey.start()
            try:
                yield self.monkey
            finally:
                self.monkey.stop()


def _compare_with_reference(overrides: list[str], run_dir: Path, summary: dict) -> dict:
    """Train the same config without faults into ``<run_dir>/reference`` and compare the two final
    evaluations row by row (GRPO's can agree exactly: a redone iteration samples as the first try)."""
    reference_dir = run_dir / "reference"
    print(f"training the same config without faults into {reference_dir}", file=sys.stderr)
    train_once(prepare([*overrides, f"runner.run_dir={reference_dir}"]))
    reference = json.loads((reference_dir / "eval.json").read_text())  # what the reference run wrote
    return compare(summary["rows"], reference["rows"])
