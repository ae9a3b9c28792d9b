"""`continuum facts MODEL.gguf`: the facts an Engine's `spec.model.facts` would hold.

Reads the GGUF header and tensor index only (`gguf.read_facts`); with `--sha256` it also
hashes the whole file and prints the `spec.model` fragment (`sha256` and `facts`), the digest
that receipts are filed under. With `--expect-sha256 HEX` (the facts Job an Engine's model is
read by) the file is hashed and must have that digest: a replaced file is refused with both
digests named. Exit codes as in `cli`: 0 done, 2 a file that cannot be read or planned from,
or whose digest is not the one expected.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.cli.output import add_output_argument, render
from continuum_operator.engine.digest import hash_file, mismatch_message
from continuum_operator.gguf import FactsError, GgufReadError, read_facts

__all__ = ["add_arguments", "cmd_facts"]


def cmd_facts(args: argparse.Namespace) -> int:
    try:
        facts = read_facts(args.model)
    except (GgufReadError, FactsError) as err:
        return fail(str(err), EXIT_INVALID)
    doc: dict[str, Any] = facts.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    if args.sha256 or args.expect_sha256:
        digest = hash_file(args.model)
        if args.expect_sha256 and digest != args.expect_sha256:
            return fail(f"{mismatch_message(args.model, digest, args.expect_sha256)}", EXIT_INVALID)
        if args.sha256:
            doc = {"sha256": digest, "facts": doc}
    print(render(doc, args.output))
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum facts` (cli.py declares the command)."""
    p.add_argument("model", type=Path, help="a GGUF model file")
    # yaml by default: the output is pasted into an Engine's spec.model.facts.
    add_output_argument(p, default="yaml", table="one row per fact")
    p.add_argument(
        "--sha256",
        action="store_true",
        help="also hash the file and print the spec.model fragment {sha256, facts}",
    )
    p.add_argument(
        "--expect-sha256",
        metavar="HEX",
        type=_sha256,
        help="hash the file and refuse it (exit 2) unless its sha256 is HEX",
    )


def _sha256(text: str) -> str:
    value = text.strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sha256 (64 hex digits)")
    return value
