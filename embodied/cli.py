"""``embodied <command> [flags] [overrides]``: train | sft | eval | evals | record | bench | plan | chaos |
check-render | setup-render.

Overrides are Hydra's, e.g. ``embodied train env=maniskill_pickcube algorithm.lr=3e-4``; flags and
overrides may come in any order. ``embodied <command> --help`` lists a command's flags.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from typing import NoReturn

from embodied import interrupts, run_owner
from embodied.commands import bench, chaos, plan, record, render, sft, train
from embodied.commands import eval as evaluation
from envs.common import UserError

# The exit codes, documented here once (docs/config.md repeats this table).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_ENV_CRASH = 3
EXIT_WORKER_FAULT = 4
EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_FAILED: "the command ran and says no (check-render / setup-render: rendering does not work here)",
    EXIT_USER_ERROR: "bad input (an unknown flag, config key or option, a value out of range, settings that cannot "
                     "work together), refused before anything runs, in one paragraph naming the fix",
    EXIT_ENV_CRASH: "a crash: the simulator (an env process died or raised; env.restart_crashed=false), or a "
                    "worker that failed to start; the last checkpoint is kept",
    EXIT_WORKER_FAULT: "a worker died or hung more often than runner.max_worker_restarts allows (a training run: "
                       "with a checkpoint written then; continue with `embodied train resume=<run_dir>`)",
}
EXIT_INTERRUPTED = interrupts.EXIT_INTERRUPTED  # 130, as a shell reports Ctrl-C; --help lists it after EXIT_CODES
INTERRUPTED = ("Ctrl-C: a training run checkpoints first and names `resume=<run_dir>` in one line; a second Ctrl-C "
               "stops at once")

COMMAND_MODULES = (train, sft, evaluation, record, bench, plan, chaos, render)  # in --help's order


class CommandLineError(Exception):
    """argparse refused the command line: ``prog`` (e.g. ``embodied eval``) and argparse's message."""

    def __init__(self, prog: str, message: str):
        self.prog, self.message = prog, message
        super().__init__(f"{prog}: {message}")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors reach :func:`main`, which prints them as every other
    bad input (``error: ...``, exit 2) and returns, instead of exiting from inside argparse."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(self.prog, message)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``embodied`` parser and each command's own (name -> parser): every module of
    embodied/commands adds its command(s) with only the flags they take."""
    parser = _Parser(prog="embodied", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>", title="commands")
    for module in COMMAND_MODULES:
        module.add_parser(subparsers)
    commands = dict(subparsers.choices)
    usages = "\n".join(map(_usage, commands.values()))
    listed = {**EXIT_CODES, EXIT_INTERRUPTED: INTERRUPTED}
    codes = "\n".join(f"  {code:<3}  {meaning}" for code, meaning in listed.items())
    parser.epilog = f"each command's flags (`embodied <command> --help` says more):\n{usages}\n\nexit codes:\n{codes}"
    return parser, commands


def _usage(parser: argparse.ArgumentParser) -> str:
    """A command's usage line(s) for ``embodied --help``, indented under its heading."""
    first, *rest = parser.format_usage().rstrip().splitlines()
    return "\n".join(["  " + first.removeprefix("usage: "), *(line[5:] for line in rest)])


def parse(argv: list[str], parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser]
          ) -> argparse.Namespace:
    """``argv`` parsed by its command's parser, which lets flags and overrides intermix
    (``embodied plan env.num_envs=64 --devices 8 policy=cnn``); raises :class:`CommandLineError`."""
    if argv and argv[0] in commands:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # --help, or no command / an unknown one: argparse's error


def _flag_owners(message: str, commands: dict[str, argparse.ArgumentParser]) -> str:
    """For an unknown flag, the commands that take it (``--faults`` is ``chaos``'s): the likely mix-up."""
    unknown = re.fullmatch(r"unrecognized arguments: (.*)", message)
    hints = []
    for flag in (arg.split("=", 1)[0] for arg in (unknown.group(1).split() if unknown else [])):
        owners = [name for name, parser in commands.items() if flag in parser._option_string_actions]
        if owners:
            hints.append(f"{flag} is a flag of `embodied {' / '.join(owners)}`")
    return f" ({'; '.join(hints)})" if hints else ""


def _quiet() -> None:
    # SAPIEN warns on every import that it uses its bundled Vulkan loader: harmless
    warnings.filterwarnings("ignore", message=".*libvulkan.*")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning")


def _explain(err: BaseException) -> tuple[str, int] | None:
    """A user-facing (message, exit code) for errors we know how to explain."""
    from envs.subproc import EnvCrashedError
    from scheduler.runtime.faults import RestartBudgetExceeded, WorkerFailure

    if isinstance(err, RestartBudgetExceeded):
        return err.message(), EXIT_WORKER_FAULT
    if isinstance(err, WorkerFailure):  # outside a training run's loop, or beyond an evaluation's retries
        return (f"{err}. Check that worker's log lines above (Ray prints them) and the machine's memory; a training "
                "run continues from its last checkpoint with `embodied train resume=<run_dir>`.", EXIT_WORKER_FAULT)
    try:
        from ray.exceptions import ActorDiedError, RayTaskError

        if isinstance(err, RayTaskError) and err.cause is not None:
            err = err.cause
        if isinstance(err, ActorDiedError) and "creation task" in str(err):
            return _explain_failed_start(str(err))
    except ImportError:
        pass
    if isinstance(err, UserError):
        return str(err), EXIT_USER_ERROR
    if isinstance(err, EnvCrashedError):
        return f"{err}\nThe last checkpoint is kept; continue with `embodied train resume=<run_dir>`.", EXIT_ENV_CRASH
    return None


def _explain_failed_start(report: str) -> tuple[str, int]:
    """A worker's constructor raised (Ray's report of it is ``report``). Bad input found only there
    (a UserError) is a config error like any other: its own paragraph, exit 2. Anything else is a
    crash: an env worker's points at the simulator, a policy worker's at the policy."""
    user_error = re.search(r"UserError: (.*)", report, re.DOTALL)
    if user_error:
        return user_error.group(1).strip(), EXIT_USER_ERROR
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    if "EnvWorker" in report:
        check = ("the env on its own (`embodied check-render`, or build it with `embodied record` and the same "
                 "overrides)")
    else:
        check = "the policy on its own (`embodied record` with the same overrides builds it in one process)"
    return f"A worker failed to start: {lines[-1]}\nCheck {check}; the traceback is above.", EXIT_ENV_CRASH


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit code is one of :data:`EXIT_CODES`, or :data:`EXIT_INTERRUPTED`. Errors we
    can explain become one paragraph on stderr (no traceback); anything else is a bug and keeps its
    traceback. Ctrl-C (embodied/interrupts.py): one line saying what is kept, exit 130."""
    _quiet()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser()
    try:
        args = parse(argv, parser, commands)
    except CommandLineError as err:
        listed = "the commands and their flags" if err.prog == parser.prog else "its flags"
        print(f"error: {err}{_flag_owners(err.message, commands)}. `{err.prog} --help` lists {listed}.",
              file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        with interrupts.handled():
            try:
                return args.run(args)
            except KeyboardInterrupt as err:
                print(interrupts.stopped_line(err), file=sys.stderr, flush=True)
                return EXIT_INTERRUPTED
    except Exception as err:
        explained = _explain(err)
        if explained is None:
            raise
        message, code = explained
        print(f"error: {message}", file=sys.stderr)
        return code
    finally:
        run_owner.release_all()  # the directories this command held (main may run again in one process)


if __name__ == "__main__":
    sys.exit(main())
