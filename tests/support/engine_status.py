"""Engines on the local control plane, read back as a user would: the body, a condition of its
status and a probe that waits for one (`is_condition`), its events, the device bytes its plan
reserves; and the facts its facts Job would have written (KWOK runs no container)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from continuum_operator.kube.workloads.facts_job import source_key
from continuum_operator.manifests import parse
from continuum_operator.model.engine import Engine
from tests.support.cluster import Cluster


def get_engine(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.get_json("engine", name, "-n", ns)
    return found


def condition(body: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return None


def is_condition(
    cluster: Cluster, ns: str, name: str, type_: str, status: str
) -> Callable[[], Any]:
    def probe() -> Any:
        body = get_engine(cluster, ns, name)
        c = condition(body, type_)
        return body if c is not None and c["status"] == status else None

    return probe


def events(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(
        "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return items


def facts_read_from_file(cluster: Cluster, ns: str, name: str) -> None:
    """The Engine's status as its facts Job leaves it: KWOK runs no container, so a test on
    KWOK nodes writes what the Job would have read (the Engine's inline facts, which such a
    test takes from the file or stands in for it). With a source, only the file's facts are
    planned from (docs/security.md)."""
    body = cluster.get_json("engine", name, "-n", ns)
    key = source_key(parse(Engine, body, f"Engine {ns}/{name}"))
    read = {"source": key, "facts": body["spec"]["model"]["facts"]}
    patch = json.dumps({"status": {"modelFacts": read}})
    cluster.kubectl(
        "patch", "engine", name, "-n", ns, "--subresource=status", "--type=merge", "-p", patch
    )


def own_device_bytes(body: dict[str, Any]) -> int:
    device = body["status"]["plan"]["bytes"]["device"]
    return int(device["weights"] + device["kv"] + device["compute"])
