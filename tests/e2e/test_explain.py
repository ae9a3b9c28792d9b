"""The generated CRDs on the real API server: `kubectl explain` describes every kind, its spec and
status, down to the deepest fields; conditions are a map keyed by type with a required reason."""

from __future__ import annotations

import json
import time

import pytest

from continuum_operator.model import crdgen
from tests.support.cluster import Cluster
from tests.support.crds import install_repo_crds

pytestmark = pytest.mark.e2e


def _explain(cluster: Cluster, field: str) -> str:
    """`kubectl explain FIELD`, retried while the server publishes the new CRDs' OpenAPI."""
    deadline = time.monotonic() + 60
    while True:
        proc = cluster.kubectl("explain", field, check=False)
        if proc.returncode == 0 or time.monotonic() > deadline:
            assert proc.returncode == 0, proc.stderr
            return proc.stdout
        time.sleep(1)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def test_kubectl_explain_describes_every_kind_its_spec_and_its_status(cluster: Cluster) -> None:
    install_repo_crds(cluster)
    for resource in crdgen.RESOURCES:
        schema = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        kind = _one_line(_explain(cluster, resource.PLURAL))
        assert schema["description"][:60] in kind, resource.KIND
        for part in ("spec", "status"):
            if part in schema["properties"]:
                shown = _one_line(_explain(cluster, f"{resource.PLURAL}.{part}"))
                assert schema["properties"][part]["description"][:60] in shown, (resource, part)


def test_kubectl_explain_reaches_the_deepest_fields(cluster: Cluster) -> None:
    install_repo_crds(cluster)
    claim = _one_line(_explain(cluster, "engines.spec.model.source.claimName"))
    assert "The PersistentVolumeClaim holding the file" in claim
    reason = _one_line(_explain(cluster, "minds.status.conditions.reason"))
    assert "as one CamelCase word" in reason


def test_a_condition_without_a_reason_or_a_second_of_one_type_is_refused(
    cluster: Cluster, namespace: str
) -> None:
    install_repo_crds(cluster)
    cluster.apply(
        {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "Mind",
            "metadata": {"name": "mira", "namespace": namespace},
            "spec": {"engine": "coder", "contextTokens": 4096},
        }
    )

    def patch(conditions: list[dict[str, str]]) -> str:
        body = json.dumps({"status": {"conditions": conditions}})
        proc = cluster.kubectl(
            "patch", "mind", "mira", "-n", namespace, "--subresource=status",
            "--type=merge", "-p", body, check=False,
        )  # fmt: skip
        return proc.stderr if proc.returncode else ""

    granted = {"type": "Granted", "status": "True", "reason": "Granted", "message": "slot 0"}
    assert patch([granted]) == ""
    no_reason = {k: v for k, v in granted.items() if k != "reason"}
    assert "status.conditions[0].reason: Required value" in patch([no_reason])
    assert "status.conditions[0].reason" in patch([{**granted, "reason": ""}])
    twice = patch([granted, {**granted, "status": "False"}])
    assert "status.conditions[1]: Duplicate value" in twice
