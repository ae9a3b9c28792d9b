"""`continuum run --class CLASS -- CMD`: run a command, and everything it starts, in a process
class (`procclass`)."""

from __future__ import annotations

import argparse

from continuum_operator.cli.errors import EXIT_INVALID, fail
from continuum_operator.procclass import (
    ENV,
    ProcessClass,
    default_class,
    run,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum run` (cli.py declares the command)."""
    p.add_argument(
        "--class",
        dest="process_class",
        choices=[str(c) for c in ProcessClass],
        default=default_class(),
        help=f"process class (default: ${ENV}, else normal)",
    )
    p.add_argument(
        "--sweep",
        type=float,
        default=2.0,
        help="seconds between passes that lower descendants running above the class",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")


def cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return fail("continuum run: no command given (continuum run -- CMD ...)", EXIT_INVALID)
    if args.sweep <= 0:
        return fail("continuum run: --sweep must be more than 0 seconds", EXIT_INVALID)
    return run(cmd, ProcessClass(args.process_class), args.sweep)
