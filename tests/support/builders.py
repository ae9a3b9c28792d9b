"""Builders for resource bodies and core inputs, shared by the unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from continuum_operator.core.pools import Board
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine
from continuum_operator.model.plan_status import PlanStatus

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MiB = 2**20
GB = 10**9
GiB = 2**30


def example(kind: str, name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / kind / f"{name}.yaml").read_text())
    return data


def board_body(
    mode: str,
    pools: list[dict[str, Any]],
    *,
    name: str = "node-a",
    cap: int | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"memoryMode": mode, "pools": pools}
    if cap is not None:
        status["perProcessCapBytes"] = cap
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "NodeBoard",
            "metadata": {"name": name}, "status": status}  # fmt: skip


def engine_body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {
            "facts": {
                "layers": 32,
                "layerBytes": 200 * MiB,
                "inputBytes": 300 * MiB,
                "outputBytes": 300 * MiB,
                "kvBytesPerTokenPerLayer": 4096,
                "computeBytes": 256 * MiB,
            }
        },
        "contextTokensPerMind": 8192,
        "minds": {"min": 1, "max": 4},
    }
    base.update(spec)
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine",
            "metadata": {"name": "eng", "namespace": "ns"}, "spec": base}  # fmt: skip


def board(body: dict[str, Any]) -> Board:
    return Board.from_resource(NodeBoard.model_validate(body))


def engine(body: dict[str, Any]) -> Engine:
    return Engine.model_validate(body)


def ledger_path(ns: str, name: str) -> str:
    """Where a fake API server keeps an Engine's GrantLedger (its path, as the operator's)."""
    from continuum_operator.kube.client.api import crd_path
    from continuum_operator.model.grant_ledger import GrantLedger

    return crd_path(GrantLedger.PLURAL, ns, name)


def split_ledger(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An Engine body a test wrote with its ledger in its status (as the operator's cache merges
    it), split into the Engine as stored and its GrantLedger (None: no ledger field in it)."""
    from continuum_operator.kube.ledger.cached import engine_only
    from continuum_operator.kube.ledger.grant_ledger import LEDGER_FIELDS

    fields = {k: v for k, v in (body.get("status") or {}).items() if k in LEDGER_FIELDS}
    if not fields:
        return engine_only(body), None
    meta = body["metadata"]
    ledger = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "GrantLedger",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "resourceVersion": str(meta.get("resourceVersion") or "1"),
        },
        "status": fields,
    }
    return engine_only(body), ledger


def stored_ledger(objects: dict[str, dict[str, Any]], ns: str, name: str) -> dict[str, Any]:
    """The status of an Engine's GrantLedger in a fake API server's objects ({}: none yet)."""
    return dict((objects.get(ledger_path(ns, name)) or {}).get("status") or {})


def observe_with_ledger(cache: Any, body: dict[str, Any], deleted: bool = False) -> None:
    """A test's Engine body (its ledger in its status) into an operator cache as the watches
    deliver it: the Engine, and its GrantLedger."""
    engine, ledger = split_ledger(body)
    cache.observe_engine(engine, deleted=deleted, nudge=False)
    if ledger is not None:
        cache.observe_ledger(ledger, deleted=deleted, nudge=False)


def engine_planned_on_a_gpu() -> tuple[Engine, PlanStatus]:
    """An Engine whose model is a hostPath file, and its plan on a node of one 80 GiB GPU: what
    the operator makes objects for (its Deployment, facts Job, lanes beside it)."""
    from continuum_operator.core.plan import plan

    body = engine_body()
    body["spec"]["model"]["source"] = {"kind": "hostPath", "path": "/srv/models/coder.gguf"}
    made = engine(body)
    node = board(
        board_body(
            "discrete",
            [
                {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 0},
                {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 0},
            ],
        )
    )
    assert made.spec.model.facts is not None
    return made, PlanStatus.model_validate(plan(node, made.spec, made.spec.model.facts).to_dict())


def plan_on_a_gpu(**fields: object) -> PlanStatus:
    """The plan of `engine_planned_on_a_gpu` with `fields` (by their Python names) in place."""
    return engine_planned_on_a_gpu()[1].model_copy(update=fields)


def tree(value: object) -> Any:
    """An object the shell built or answered, as a test reads it: every field reachable by
    index (the product narrows what it reads; a test states the fields it expects)."""
    return value
