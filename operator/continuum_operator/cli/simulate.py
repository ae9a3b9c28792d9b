"""`continuum simulate`: a scenario file through the real allocator in virtual time
(`scenario`), its report printed as a table or as JSON/YAML."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from continuum_operator.cli.errors import fail
from continuum_operator.cli.output import add_output_argument, render
from continuum_operator.core.simulate import (
    ScenarioTooLarge,
    simulate,
)
from continuum_operator.scenario import load


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        scenario = load(args.scenario)
    except ValueError as err:
        return fail(str(err), 2)
    try:
        result = simulate(scenario)
    except ScenarioTooLarge as err:
        return fail(f"{args.scenario}: {err}", 2)
    if args.log:
        with args.log.open("w") as out:
            for line in result.log:
                out.write(json.dumps(line, separators=(",", ":")) + "\n")
    if args.output != "table":
        print(render(result.summary, args.output))
    else:
        s = result.summary
        print(f"virtual time {s['duration']:.0f} s, {s['events']} events")
        print(f"grants {s['grants']}, reclaim cycles {s['reclaimCycles']}")
        print("reclaims: " + (", ".join(f"{k} {v}" for k, v in s["reclaims"].items()) or "none"))
        t = s["turns"]
        print(f"turns: {t['completed']} completed, {t['cut']} cut, {t['refused']} refused")
        for reason, w in s["waits"].items():
            print(
                f"waits {reason}: {w['count']} (p50 {w['p50']:.1f} s, p99 {w['p99']:.1f} s, "
                f"max {w['max']:.1f} s, {w['abandoned']} abandoned at the deadline)"
            )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum simulate` (cli.py declares the command)."""
    p.add_argument("scenario", type=Path, help="a scenario YAML file (docs/simulate.md)")
    p.add_argument("--log", type=Path, help="write the transition log here (JSON lines)")
    add_output_argument(p, table="the summary's figures, one line each")
