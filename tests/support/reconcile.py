"""One Engine's pass from a snapshot: the time, the settings, boards and engines built for a
pass (`snapshot`, `engine_obj`), and what a pass decided (`after`, `conditions`)."""

from __future__ import annotations

import copy
from typing import Any

from continuum_operator.core.damping import DampingSettings
from continuum_operator.kube.base.settings import (
    OperatorSettings,
    PlacementSettings,
    PodSettings,
)
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.engines.engine_pass import Writes
from continuum_operator.kube.state.cache import (
    BoardEntry,
    DeploymentEntry,
    NodeEntry,
    Snapshot,
)
from continuum_operator.kube.state.lease_renewal import LeaseEntry
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from continuum_operator.kube.workloads.facts_job import source_key
from continuum_operator.model.engine import Engine
from tests.support.builders import GiB, board, board_body, engine_body

NOW = 1_800_000_000.0


SETTINGS = OperatorSettings(
    placement=PlacementSettings(pod_start_timeout_seconds=60, backoff_seconds=300),
    damping=DampingSettings(readings_required=3, min_gain=0.10, cooldown_seconds=120),
    # The cluster admin's model directories for the hostPath sources below.
    pods=PodSettings(allowed_host_path_prefixes=("/models", "/srv/models")),
)


def with_file_facts(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as the facts Job leaves it: the file's facts (here its inline ones) in status."""
    out = copy.deepcopy(body)
    key = source_key(Engine.model_validate(out))
    facts = copy.deepcopy(out["spec"]["model"]["facts"])
    out.setdefault("status", {})["modelFacts"] = {"source": key, "facts": facts}
    return out


def discrete(
    name: str, device_gib: int, used_gib: int = 0, host_gib: int = 256, own: int = 0
) -> BoardEntry:
    """A one-GPU board; `own` adds the measured bytes of an engine already running there."""
    body = board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": host_gib * GiB, "usedBytes": 4 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB,
             "usedBytes": used_gib * GiB + own},
        ],
        name=name,
    )  # fmt: skip
    return BoardEntry(board(body), resource_version=f"rv-{name}-{used_gib}-{own}")


def own_device_bytes(body: dict[str, Any]) -> int:
    """What the agent measures of a running engine on its GPU: its bytes, not its reserve."""
    device = body["status"]["plan"]["bytes"]["device"]
    return int(device["weights"] + device["kv"] + device["compute"])


def snapshot(
    boards: list[BoardEntry],
    *,
    stale: set[str] = frozenset(),  # type: ignore[assignment]
    engines: dict[tuple[str, str], Any] | None = None,
    deployments: dict[tuple[str, str], DeploymentEntry] | None = None,
    lease_rv: str = "1",
) -> Snapshot:
    nodes = {b.board.node: NodeEntry({}, 8) for b in boards if b.board}
    leases = {
        b.board.node: LeaseEntry(
            renew_time=NOW - (7200 if b.board.node in stale else 1),
            duration_seconds=3600,
            resource_version=lease_rv,
        )
        for b in boards
        if b.board
    }
    return Snapshot(
        boards={b.board.node: b for b in boards if b.board},
        leases=leases,
        nodes=nodes,
        engines=engines or {},
        deployments=deployments or {},
    )


def engine_obj(name: str = "coder", **spec: Any) -> dict[str, Any]:
    body = engine_body(**spec)
    body["metadata"] = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                        "resourceVersion": "10"}  # fmt: skip
    return body


def after(body: dict[str, Any], writes: Writes) -> dict[str, Any]:
    """The engine as the API server would hold it after the status patch (merge patch)."""
    out: dict[str, Any] = merge_patch(body, writes.status_patch or {})
    return out


def conditions(body: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in body["status"]["conditions"]}


def ready(writes: Writes) -> DeploymentEntry:
    assert writes.deployment is not None
    launch = writes.deployment["metadata"]["annotations"][LAUNCH_ANNOTATION]
    return DeploymentEntry(launch, 1, 1, 1, 1, 1)
