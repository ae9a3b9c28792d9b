"""EmbedLanes and the engines they follow, as objects and in a snapshot, for the tests of the
lanes' pass and loop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.lanes.lane_pass import LaneWrites, reconcile_lane
from continuum_operator.kube.state.cache import Snapshot
from continuum_operator.model.base import API_VERSION
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    discrete,
    engine_obj,
    snapshot,
    with_file_facts,
)


def lane_obj(name: str = "lane", engine: str | None = "coder", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"maxContextTokens": 8192, **spec}
    if engine is not None:
        body["engine"] = engine
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
            "metadata": {"name": name, "namespace": "ns", "generation": 1,
                         "resourceVersion": "20"},
            "spec": body}  # fmt: skip


def placed_engine(snap: Snapshot, **spec: Any) -> dict[str, Any]:
    """The engine `coder` after its first pass on `snap` (placed, assumed lease); with a model
    source, its facts Job has read the file (`with_file_facts`)."""
    body = engine_obj("coder", **spec)
    if body["spec"]["model"].get("source"):
        body = with_file_facts(body)
    return after(body, reconcile(body, snap, Memory(), NOW, SETTINGS))


def with_objects(
    snap: Snapshot, engines: list[dict[str, Any]], lanes: list[dict[str, Any]]
) -> Snapshot:
    def key(b: dict[str, Any]) -> tuple[str, str]:
        return (b["metadata"]["namespace"], b["metadata"]["name"])

    return replace(snap, engines={key(e): e for e in engines}, lanes={key(x): x for x in lanes})


SOURCE = {"kind": "hostPath", "path": "/srv/models/embed.gguf"}


SHA = "b" * 64


def host_engine() -> tuple[Snapshot, dict[str, Any]]:
    """A node and an engine placed on it with every layer on the host (a model file)."""
    base = snapshot([discrete("gpu-a", 80)])
    facts = engine_obj()["spec"]["model"]["facts"]
    eng = placed_engine(base, offload="none", model={"source": SOURCE, "sha256": SHA,
                                                     "facts": facts})  # fmt: skip
    return base, eng


def host_lane(settings: OperatorSettings = SETTINGS) -> tuple[dict[str, Any], LaneWrites]:
    """A lane beside an engine with every layer on the host (a model file of its own)."""
    base, eng = host_engine()
    lane = lane_obj()
    lane["metadata"]["uid"] = "uid-lane"
    return lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW, settings)


def lane(name: str, engine: str | None, node: str | None = None, rv: str = "1") -> dict[str, Any]:
    spec: dict[str, Any] = {"maxContextTokens": 256}
    if engine is not None:
        spec["engine"] = engine
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "EmbedLane",
        "metadata": {"namespace": "ns", "name": name, "resourceVersion": rv, "generation": 1},
        "spec": spec,
    }
    if node is not None:
        body["status"] = {"placement": {"node": node, "pools": [{"pool": "host", "bytes": 1}]}}
    return body


def engine(name: str, ns: str = "ns", rv: str = "1") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Engine",
            "metadata": {"namespace": ns, "name": name, "resourceVersion": rv},
            "spec": {}}  # fmt: skip
