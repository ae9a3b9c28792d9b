"""The operator's watches are filtered on the API server (`kube.state.handlers.select_on_server`):
the agents' Leases by their label (never the kubelets' Leases beside them), and only the
Deployments, Jobs and Services the operator made; the agent labels every Lease it writes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kopf

from continuum_operator.agent.writer import AgentApi
from continuum_operator.core.heartbeat import (
    AGENT_LEASE_LABELS,
    AGENT_LEASE_SELECTOR,
    NODE_ANNOTATION,
    agent_lease_metadata,
    node_of_lease,
)
from continuum_operator.kube.state.handlers import select_on_server
from continuum_operator.kube.workloads.engine_objects import MANAGED_BY


def _selectors(settings: kopf.OperatorSettings, group: str, plural: str) -> list[str]:
    resource = kopf.Resource(group, "v1", plural)
    return list(settings.watching.label_selectors.collect(resource))


def test_leases_and_owned_objects_are_selected_on_the_server() -> None:
    settings = kopf.OperatorSettings()
    select_on_server(settings)
    assert _selectors(settings, "coordination.k8s.io", "leases") == [AGENT_LEASE_SELECTOR]
    owned = [f"app.kubernetes.io/managed-by={MANAGED_BY}"]
    assert _selectors(settings, "apps", "deployments") == owned
    assert _selectors(settings, "batch", "jobs") == owned
    assert _selectors(settings, "", "services") == owned
    # What the operator must see whoever made it: no selector.
    assert _selectors(settings, "", "nodes") == []
    assert _selectors(settings, "continuum.dev", "nodeboards") == []


def test_an_operators_engine_selector_is_applied_by_the_api_server() -> None:
    # So an Engine relabelled out of it reaches the watch as DELETED (test_grants e2e).
    settings = kopf.OperatorSettings()
    select_on_server(settings, {"shard": "a", "team": "ml"})
    assert _selectors(settings, "continuum.dev", "engines") == ["shard=a,team=ml"]
    everyone = kopf.OperatorSettings()
    select_on_server(everyone)
    assert _selectors(everyone, "continuum.dev", "engines") == []


def test_the_selector_matches_the_labels_of_an_agent_lease() -> None:
    meta = agent_lease_metadata("gpu-node-1")
    wanted = dict(pair.split("=", 1) for pair in AGENT_LEASE_SELECTOR.split(","))
    assert wanted.items() <= meta["labels"].items()
    assert node_of_lease(meta["name"], meta["annotations"]) == "gpu-node-1"


class _Coordination:
    """CoordinationV1Api's two calls the agent makes, recorded."""

    def __init__(self, exists: bool) -> None:
        self.exists = exists
        self.patches: list[dict[str, Any]] = []
        self.created: list[Any] = []

    def patch_namespaced_lease(self, name: str, ns: str, body: dict[str, Any], **_: Any) -> None:
        from kubernetes import client

        if not self.exists:
            raise client.ApiException(status=404)
        self.patches.append(body)

    def create_namespaced_lease(self, ns: str, body: Any, **_: Any) -> None:
        self.created.append(body)


def _agent(coordination: _Coordination) -> AgentApi:
    agent = AgentApi.__new__(AgentApi)
    agent.node = "gpu-node-1"
    agent.identity = "agent-test"
    agent.lease_seconds = 40
    agent.lease_namespace = "kube-node-lease"
    agent._coordination = coordination  # type: ignore[assignment]
    return agent


def test_the_agent_labels_the_lease_it_creates_and_each_it_renews() -> None:
    now = datetime(2026, 12, 3, tzinfo=UTC)
    fresh = _Coordination(exists=False)
    _agent(fresh).renew_lease(now, None)
    assert fresh.created[0].metadata.labels == AGENT_LEASE_LABELS
    # A Lease an older agent made without the label is labelled by the next renewal.
    old = _Coordination(exists=True)
    _agent(old).renew_lease(now, None)
    assert old.patches[0]["metadata"]["labels"] == AGENT_LEASE_LABELS
    # And the node it vouches for: an annotation another writer changed is put back at the
    # next beat (found by review: the operator read no node from such a Lease, for good).
    assert old.patches[0]["metadata"]["annotations"] == {NODE_ANNOTATION: "gpu-node-1"}
