"""One `-o` vocabulary for every `continuum` command that prints: `table`, `json` or `yaml`.

`table` is the view for people (each command says what its table shows); `json` and `yaml` are
the same document for tools. A word another command once used (`text`) is refused with the word
that replaced it, rather than kept as a second spelling: two spellings would live on in scripts
and docs, and a script that used the old one fails once, at parse time, saying what to write.
Neighbours: `cli.py` (the command) and each subcommand's module, which register `-o` here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

from continuum_operator import yaml_text

OUTPUTS = ("table", "json", "yaml")
RENAMED = {"text": "table"}


def output_format(value: str) -> str:
    """argparse's `type` for `-o`: one of OUTPUTS, or an error naming them."""
    if value in OUTPUTS:
        return value
    if value in RENAMED:
        raise argparse.ArgumentTypeError(
            f"{value!r} is now {RENAMED[value]!r}: every continuum command takes -o table, "
            "json or yaml"
        )
    raise argparse.ArgumentTypeError(f"invalid choice {value!r}: choose table, json or yaml")


def add_output_argument(
    parser: argparse.ArgumentParser, *, default: str = "table", table: str = ""
) -> None:
    """Register `-o/--output {table,json,yaml}`; `table` says what the table view shows."""
    assert default in OUTPUTS
    shown = f" (table: {table})" if table else ""
    parser.add_argument(
        "-o",
        "--output",
        type=output_format,
        default=default,
        metavar="{table,json,yaml}",
        help=f"how to print{shown}; default {default}",
    )


def render(doc: Any, output: str, table: Callable[[], str] | None = None) -> str:
    """`doc` as `output`, without the final newline; `table` draws the table view (default:
    one `path: value` row per leaf of the document)."""
    if output == "json":
        return json.dumps(doc, indent=2)
    if output == "yaml":
        return yaml_text.dump(doc, sort_keys=False).rstrip("\n")
    if table is not None:
        return table()
    return leaf_table(doc)


def leaf_table(doc: Any) -> str:
    """One row per leaf, its dotted path beside its value: a nested document read at a glance."""
    rows = list(_leaves(doc, ""))
    width = max((len(path) for path, _ in rows), default=0)
    return "\n".join(f"{path + ':':<{width + 1}} {value}" for path, value in rows)


def _leaves(node: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(node, Mapping):
        if not node:
            return [(path, "{}")] if path else []
        out: list[tuple[str, str]] = []
        for key, value in node.items():
            out += _leaves(value, f"{path}.{key}" if path else str(key))
        return out
    if isinstance(node, list):
        if all(not isinstance(v, Mapping | list) for v in node):
            return [(path, ", ".join(str(v) for v in node) or "[]")]
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, "-" if node is None else str(node))]
