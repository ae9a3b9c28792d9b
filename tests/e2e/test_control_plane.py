"""Smoke tests of the local control plane (tools/cluster): the real API server, controllers,
scheduler and KWOK fake GPU nodes that the operator's end-to-end tests run against."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import yaml_text
from tests.support.builders import ROOT
from tests.support.cluster import Cluster, read_versions
from tests.support.crds import install_repo_crds, wait_established, yaml_docs

pytestmark = pytest.mark.e2e

ENGINE_EXAMPLES = ROOT / "examples" / "engines"


def is_subset(expected: Any, actual: Any) -> bool:
    """Whether `actual` holds everything in `expected` (the server may add defaults)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and is_subset(v, actual[k]) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(is_subset(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return bool(expected == actual)


def test_version_is_pinned(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == read_versions()["KUBERNETES_VERSION"]
    assert cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_custom_resource_roundtrip(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """A CRD of our own: established, then an object of it is stored and read back."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.smoke.continuum.test"},
        "spec": {
            "group": "smoke.continuum.test",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "size": {"type": "string"},
                                        "replicas": {"type": "integer", "default": 1},
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    (tmp_path / "crd.yaml").write_text(yaml_text.dump(crd))
    cluster.kubectl("apply", "-f", str(tmp_path / "crd.yaml"))
    wait_established(cluster, ["widgets.smoke.continuum.test"])
    widget = {
        "apiVersion": "smoke.continuum.test/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"size": "7Gi"},
    }
    cluster.apply(widget, "-n", namespace)
    stored = cluster.get_json("-n", namespace, "widget", "w")
    assert stored["spec"] == {"size": "7Gi", "replicas": 1}  # structural defaulting ran


def test_repo_crds_install(cluster: Cluster) -> None:
    names = install_repo_crds(cluster)
    for name in names:
        crd = cluster.get_json(f"crd/{name}")
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", name


def test_engine_examples_are_stored(cluster: Cluster, namespace: str) -> None:
    """The example Engines apply as written (into their own namespace, else a fresh one) and read
    back with the same spec."""
    install_repo_crds(cluster)
    examples = sorted(ENGINE_EXAMPLES.glob("*.yaml"))
    assert examples, f"no examples in {ENGINE_EXAMPLES}"
    applied: list[tuple[str, str, str]] = []
    try:
        for path in examples:
            for doc in yaml_docs(path):
                ns = doc["metadata"].get("namespace") or namespace
                if ns != namespace:
                    cluster.apply(
                        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                    )
                cluster.apply(doc, "-n", ns)
                resource = f"{doc['kind'].lower()}.{doc['apiVersion'].split('/')[0]}"
                applied.append((ns, resource, doc["metadata"]["name"]))
                stored = cluster.get_json("-n", ns, resource, doc["metadata"]["name"])
                assert is_subset(doc.get("spec", {}), stored.get("spec", {})), (path, stored)
    finally:
        for ns, resource, name in applied:
            cluster.kubectl(
                "delete",
                "-n",
                ns,
                resource,
                name,
                "--wait=false",
                "--ignore-not-found",
                check=False,
            )


def test_deployment_runs_on_fake_gpu_node(cluster: Cluster, namespace: str, gpu_node: str) -> None:
    node = cluster.get_json(f"node/{gpu_node}")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {
                "metadata": {"labels": {"app": "engine"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": gpu_node},
                    "containers": [
                        {
                            "name": "engine",
                            "image": "example.invalid/engine:0",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        },
    }
    cluster.apply(deployment, "-n", namespace)
    deadline = time.monotonic() + 90
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        pods = cluster.get_json("-n", namespace, "pods", "-l", "app=engine")["items"]
        if any(p["status"].get("phase") == "Running" for p in pods):
            break
        time.sleep(0.5)
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    assert running, f"no Running pod: {json.dumps(pods, indent=1)[:4000]}"
    assert running[0]["spec"]["nodeName"] == gpu_node
    cluster.kubectl("rollout", "status", "-n", namespace, "deployment/engine", "--timeout=60s")
