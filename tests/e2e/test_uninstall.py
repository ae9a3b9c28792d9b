"""`continuum release-finalizers` (the chart's pre-delete hook) on the real control plane, run as
a local process: it scales a stand-in operator Deployment to 0 and waits for its pods (KWOK runs
them) to go, then takes continuum.dev/grant off every Mind: a deleted Mind stuck Terminating
goes, a living one keeps her other finalizers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from continuum_operator.kube.grants.mind_writes import FINALIZER
from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds"]  # a fixture, used by name

KEEP = "example.com/keep"


def mind(name: str, *finalizers: str) -> dict[str, object]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": name, "finalizers": list(finalizers)},
        "spec": {"engine": "coder", "contextTokens": 4096},
    }


def stand_in_operator(node: str) -> dict[str, object]:
    labels = {"app": "stand-in-operator"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "op"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeName": node,
                    "containers": [{"name": "op", "image": "continuum-operator:e2e"}],
                },
            },
        },
    }


def pods(cluster: Cluster, ns: str) -> list[object]:
    found = cluster.get_json("pods", "-n", ns, "-l", "app=stand-in-operator")["items"]
    return list(found)


@pytest.fixture
def minds(cluster: Cluster, crds: None, namespace: str) -> Iterator[str]:
    yield namespace
    # Whatever the test left: nothing of ours may hold the namespace's deletion up.
    for name in ("alive", "deleted"):
        cluster.kubectl(
            "patch", "mind", name, "-n", namespace, "--type=merge",
            "-p", '{"metadata":{"finalizers":[]}}', check=False,
        )  # fmt: skip


def test_release_finalizers_stops_the_operator_then_frees_every_mind(
    cluster: Cluster, minds: str, gpu_node: str
) -> None:
    ns = minds
    cluster.apply(stand_in_operator(gpu_node), "-n", ns)
    wait_for("the stand-in operator's pods", lambda: len(pods(cluster, ns)) == 2)
    cluster.apply([mind("alive", KEEP, FINALIZER), mind("deleted", FINALIZER)], "-n", ns)
    cluster.kubectl("delete", "mind", "deleted", "-n", ns, "--wait=false")
    stuck = cluster.get_json("mind", "deleted", "-n", ns)
    assert stuck["metadata"]["deletionTimestamp"]  # Terminating: her finalizer holds her

    proc = subprocess.run(
        [sys.executable, "-m", "continuum_operator.cli", "release-finalizers",
         "--kubeconfig", str(cluster.kubeconfig), "--stop-operator", f"{ns}/op",
         "--timeout", "90"],
        capture_output=True, text=True, timeout=180, check=False, env=cluster.env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"released minds {ns}/alive" in proc.stdout
    assert f"released minds {ns}/deleted" in proc.stdout

    assert cluster.get_json("deployment", "op", "-n", ns)["spec"]["replicas"] == 0
    assert pods(cluster, ns) == []  # it returned only once they were gone
    gone = cluster.kubectl("get", "mind", "deleted", "-n", ns, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    alive = cluster.get_json("mind", "alive", "-n", ns)
    assert alive["metadata"]["finalizers"] == [KEEP]
    assert not alive["metadata"].get("deletionTimestamp")
