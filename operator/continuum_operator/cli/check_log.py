"""`continuum check-log`: judge a grant transition log (`checklog`) and print the violations;
its exit code says whether any invariant broke: 0 none, 1 some (`EXIT_VIOLATIONS`), 2 a log that
cannot be read (as in `cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from continuum_operator.checklog import LogFormatError, check_file
from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.cli.output import add_output_argument, render

#: Exit code of a log in which an invariant broke.
EXIT_VIOLATIONS = 1


def cmd_check_log(args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        violations = check_file(path)
    except LogFormatError as err:
        where = f"{path}:{err.line}" if err.line else str(path)
        return fail(f"{where}: {err.message}", EXIT_INVALID)
    except OSError as err:
        return fail(f"{path}: {err.strerror or err}", EXIT_INVALID)
    if args.output != "table":
        doc = {"ok": not violations, "violations": [v.to_dict() for v in violations]}
        print(render(doc, args.output))
    elif violations:
        for v in violations:
            print(v)
        print(f"{len(violations)} violation(s) in {path}")
    else:
        print(f"ok: {path}: invariants 1-7 hold")
    return EXIT_VIOLATIONS if violations else EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum check-log` (cli.py declares the command)."""
    p.add_argument("file", type=Path, metavar="FILE", help="a transition log, JSON lines")
    add_output_argument(p, table="one line per violation, or ok")
