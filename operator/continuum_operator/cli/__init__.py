"""The `continuum` command: the table of its subcommands (`cli.command`), each one's argument
parsing and output in a module of this package (`cli.plan`, `cli.place`, ...), the work itself in
the package that does it. Exit codes follow one rule (`cli.errors`).

The processes import this package's small parts (`cli.args`, `cli.errors`, `cli.output`), and the
table imports every process, so the table is imported only when the command runs: `main` and
`build_parser` here reach it at their call.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from continuum_operator.cli.command import build_parser as build

    return build()


def main(argv: Sequence[str] | None = None) -> int:
    from continuum_operator.cli.command import main as run

    return run(argv)
