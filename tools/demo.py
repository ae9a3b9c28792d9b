"""The demo's main job, run by tools/demo once the control plane and CRDs are up.

Applies the example boards (their status through the status subresource, as the node agent
writes it) and engines with kubectl, reads them back from the API server, plans every engine on
every board with the same core `continuum plan` uses, and writes each engine's best plan and
its assumed placement to the Engine's status. Until the operator lands, this script plays its
part for one pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from continuum_operator.cli import plan_table
from continuum_operator.core.placements import placement_of
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, Ledger
from continuum_operator.model import Engine, NodeBoard

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def kubectl(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"demo: kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def apply_boards() -> None:
    for path in sorted((EXAMPLES / "boards").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        status = doc.pop("status")
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
        kubectl(
            "patch",
            "nodeboard",
            doc["metadata"]["name"],
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )
        print(f"nodeboard/{doc['metadata']['name']} applied ({status['memoryMode']})")


def apply_engines() -> None:
    namespaces = {
        yaml.safe_load(p.read_text())["metadata"]["namespace"]
        for p in (EXAMPLES / "engines").glob("*.yaml")
    }
    for ns in sorted(namespaces):
        manifest = kubectl("create", "namespace", ns, "--dry-run=client", "-o", "yaml")
        kubectl("apply", "-f", "-", stdin=manifest)
    print(kubectl("apply", "-f", str(EXAMPLES / "engines")), end="")


def rank(p: ServingPlan) -> tuple[bool, int, int]:
    return (p.schedulable, p.layers_on_device, p.pool_tokens)


def main() -> int:
    apply_boards()
    apply_engines()
    boards = [
        NodeBoard.model_validate(item)
        for item in json.loads(kubectl("get", "nodeboards", "-o", "json"))["items"]
    ]
    engines = [
        Engine.model_validate(item)
        for item in json.loads(kubectl("get", "engines", "-A", "-o", "json"))["items"]
    ]
    for engine in engines:
        facts = engine.spec.model.facts
        assert facts is not None
        plans = []
        for board in boards:
            core_board = Board.from_resource(board)
            plans.append(plan(core_board, engine.spec, facts, Ledger(core_board)))
        best = max(plans, key=rank)
        name = f"{engine.metadata.namespace}/{engine.metadata.name}"
        print(
            f"\n=== Engine {name}: "
            + ", ".join(
                f"{p.node} {p.layers_on_device}/{p.total_layers} layers x{p.minds_grantable}"
                if p.schedulable
                else f"{p.node} unschedulable"
                for p in plans
            )
        )
        print(f"--- best: {best.node}")
        print(plan_table(best))
        status = {"plan": best.to_dict(), "placement": placement_of(best).model_dump(by_alias=True)}
        kubectl(
            "patch",
            "engine",
            engine.metadata.name,
            "-n",
            str(engine.metadata.namespace),
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )
    print()
    print(kubectl("get", "nodeboards"), end="")
    print(kubectl("get", "engines", "-A", "-o", "wide"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
