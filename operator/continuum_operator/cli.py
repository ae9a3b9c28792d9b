"""The `continuum` command: offline planning now; operator, agent and engine as they land.

Exit codes follow one rule across subcommands: 0 done, 2 invalid input (a message naming the
file, the field path and what is wrong), 3 a valid request that cannot be satisfied (reasons
printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from continuum_operator import checklog, cli_facts, cli_model, cli_place, procclass, scenario
from continuum_operator.agent import cli as agent_cli
from continuum_operator.cli_errors import fail
from continuum_operator.cli_output import add_output_argument, render
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.embed import runtime as embed_runtime
from continuum_operator.engine import runtime as engine_runtime
from continuum_operator.engine import turn as turn_cli
from continuum_operator.engine.receipts import ReceiptFileError, load_receipts
from continuum_operator.kube import release as release_cli
from continuum_operator.kube import run as operator_cli
from continuum_operator.manifests import ManifestError, load_all, load_one
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_UNSCHEDULABLE = 3


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def plan_table(p: ServingPlan) -> str:
    rows = [
        ("Node", p.node),
        ("Memory mode", f"{p.memory_mode}" + ("" if p.governed else " (device ungoverned)")),
        ("Schedulable", "yes" if p.schedulable else "no"),
        ("Layers on device", f"{p.layers_on_device}/{p.total_layers}"
         + (" (GPU-servable)" if p.gpu_servable else "")),
        ("Minds grantable", f"{p.minds_grantable} x {p.context_tokens_per_mind} tokens"),
        ("Pool tokens", f"{p.pool_tokens} ({p.kv_cache_type})"),
        ("Budget", f"device {_mib(p.budget.device)}, host {_mib(p.budget.host)}, "
         f"per-process cap {_mib(p.budget.per_process_cap)}"),
    ]  # fmt: skip
    out = [f"{k + ':':<18} {v}" for k, v in rows]
    out.append("")
    out.append(
        f"{'BYTES':<8} {'WEIGHTS':>12} {'KV':>12} {'COMPUTE':>12} {'RESERVE':>12} {'TOTAL':>12}"
    )
    for side, part in (("device", p.device), ("host", p.host)):
        cells = (part.weights, part.kv, part.compute, part.reserve, part.total)
        out.append(f"{side:<8} " + " ".join(f"{_mib(c):>12}" for c in cells))
    out.append("")
    out.append("Charges: " + (", ".join(f"{pool} {_mib(n)}" for pool, n in p.charges) or "none"))
    out.append("Engine args: " + " ".join(p.engine_args))
    out.append("Reasons:")
    out.extend(f"  {r.code}: {r.message}" for r in p.reasons)
    return "\n".join(out)


def _print_plan(p: ServingPlan, output: str) -> None:
    doc: dict[str, Any] = p.to_dict()
    print(render(doc, output, lambda: plan_table(p)))


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or why there is none."""
    try:
        return package_version("continuum-operator")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (continuum-operator is not installed: pip install -e .)"


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        board = load_one(NodeBoard, args.board)
        engine = load_one(Engine, args.engine)
        others = [e for path in args.lease for e in load_all(Engine, path)]
        receipts = load_receipts(args.receipt)
    except (ManifestError, ReceiptFileError) as err:
        return fail(str(err), EXIT_INVALID)
    facts = engine.spec.model.facts
    if facts is None:
        return fail(
            f"{args.engine}: spec.model.facts: this Engine names a model source but no "
            "inline facts; run `continuum facts MODEL.gguf` and put its output in "
            "spec.model.facts to plan offline",
            EXIT_INVALID,
        )
    me = (engine.metadata.namespace, engine.metadata.name)
    leases = engine_leases(e for e in others if (e.metadata.namespace, e.metadata.name) != me)
    core_board = Board.from_resource(board)
    result = plan(
        core_board, engine.spec, facts, BoardLeases.of(core_board, leases), receipts=receipts
    )
    _print_plan(result, args.output)
    if not result.schedulable:
        for reason in result.reasons:
            print(f"unschedulable: {reason.code}: {reason.message}", file=sys.stderr)
        return EXIT_UNSCHEDULABLE
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="continuum", description="Memory and turns for local-model serving."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "plan",
        help="plan an Engine on one node's board, offline",
        description="Compute the serving plan of an Engine on a NodeBoard, as the operator would.",
    )
    p.add_argument("--board", type=Path, required=True, help="a NodeBoard YAML file")
    p.add_argument("--engine", type=Path, required=True, help="an Engine YAML file")
    cli_place.add_placed_inputs(p)
    add_output_argument(p, table="the plan's rows, bytes per side and its reasons")
    p.set_defaults(func=cmd_plan)
    cli_place.add_parser(sub)
    scenario.add_parser(sub)
    checklog.add_parser(sub)
    cli_facts.add_parser(sub)
    cli_model.add_parser(sub)
    engine_runtime.add_parser(sub)
    turn_cli.add_parser(sub)
    embed_runtime.add_parser(sub)
    agent_cli.add_parser(sub)
    operator_cli.add_parser(sub)
    release_cli.add_parser(sub)
    procclass.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
