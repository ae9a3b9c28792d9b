"""`continuum plan`: the serving plan of an Engine on one NodeBoard, offline, as the operator
would compute it, printed as a table or as JSON/YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from continuum_operator.cli import place as cli_place
from continuum_operator.cli import replay as cli_replay
from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, EXIT_UNSCHEDULABLE, fail
from continuum_operator.cli.output import add_output_argument, render
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.engine.receipts import ReceiptFileError, load_receipts
from continuum_operator.manifests import ManifestError, load_all, load_one
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine


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


def cmd_plan(args: argparse.Namespace) -> int:
    if args.replay:
        return cli_replay.cmd_replay(args)
    if args.board is None or args.engine is None:
        return fail(
            "plan needs --board FILE and --engine FILE (or --replay, with --engines and "
            "--boards, to re-plan every placed Engine before an upgrade)",
            EXIT_INVALID,
        )
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum plan`."""
    p.add_argument("--board", type=Path, help="a NodeBoard YAML file")
    p.add_argument("--engine", type=Path, help="an Engine YAML file")
    cli_place.add_placed_inputs(p)
    cli_replay.add_arguments(p)
    add_output_argument(p, table="the plan's rows, bytes per side and its reasons")
