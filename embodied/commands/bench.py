"""``embodied bench <name> [overrides] [--json] [--iterations N]``: run a benchmark of
``embodied/bench/`` (``pipeline``: serial colocated vs pipelined, k = 1, 2, 4; ``overhead``: the train loop
against a plain one-process loop on the free simulator, collection against raw simulator processes; its
settings are named: ``embodied bench overhead state-4096 rgb64-256``) and print its table
(or JSON); its files go to ``bench/<name>-<time>/``.

A benchmark composes its own configs from the overrides (it compares several), so ``--cfg`` and
``--config`` do not apply.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from embodied.bench import BENCHES
from envs.common import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``bench``: the benchmark's name, its overrides, ``--json`` and ``--iterations``."""
    parser = subparsers.add_parser("bench", help="a benchmark's table (and files under bench/)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--iterations", type=int, default=2, metavar="N",
                        help="measured iterations per mode (default: 2)")
    parser.add_argument("name", nargs="?", help=f"the benchmark: one of {', '.join(BENCHES)}")
    parser.add_argument("overrides", nargs="*", metavar="override", help="Hydra overrides for its configs")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the named benchmark; progress goes to stderr, the table (or JSON) to stdout."""
    return bench(args.name, args.overrides, args.json, args.iterations)


def bench(name: str | None, overrides: list[str], as_json: bool, iterations: int) -> int:
    """``embodied bench <name> [overrides]``: print the table (or JSON); files go to bench/<name>-<time>/."""
    from embodied.run_dirs import make_unique_dir, stamp

    if not name:
        raise UserError(f"embodied bench needs a benchmark name: one of {', '.join(BENCHES)}.")
    module = importlib.import_module(BENCHES.get(name))
    out_dir = make_unique_dir(Path("bench"), f"{name}-{stamp()}")
    summary = module.run(overrides, iterations=iterations, out_dir=out_dir)  # progress goes to stderr
    print(json.dumps(summary, indent=2) if as_json else module.markdown(summary) + f"\nfiles: {out_dir.resolve()}")
    return 0
