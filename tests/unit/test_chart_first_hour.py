"""The chart as a newcomer meets it: values-gpu.yaml renders an NVIDIA cluster's install (the
agent under the nvidia RuntimeClass, GPU sharing, monitors, alerts and the dashboard, the images
it names), and NOTES.txt names the namespace the examples need and how to see an operator lead."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm import CHART, by_kind, documents, find_helm, helm, one, template

VALUES_GPU = CHART / "values-gpu.yaml"


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    return find_helm()


@pytest.fixture(scope="module")
def gpu_docs(helm_bin: Path) -> list[dict[str, Any]]:
    return documents(template(helm_bin, yaml.safe_load(VALUES_GPU.read_text())).stdout)


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"]["containers"][0])


def test_values_gpu_passes_helm_lint(helm_bin: Path) -> None:
    helm(helm_bin, "lint", str(CHART), "-f", str(VALUES_GPU))


def test_values_gpu_runs_the_agent_with_nvml_and_the_operator_with_gpu_sharing(
    gpu_docs: list[dict[str, Any]],
) -> None:
    values = yaml.safe_load(VALUES_GPU.read_text())
    agent = one(gpu_docs, "DaemonSet", "-agent")
    assert agent["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    images = values["images"]
    assert container(agent)["image"] == f"{images['agent']['repository']}:{images['agent']['tag']}"
    operator = one(gpu_docs, "Deployment", "-operator")
    args = container(operator)["args"]
    assert "--gpu-sharing=auto" in args
    assert "--allowed-host-path-prefix=/var/lib/continuum/models" in args  # tiny-chat's model
    engine = f"{images['engine']['repository']}:{images['engine']['tag']}"
    assert f"--engine-image={engine}" in args
    op = images["operator"]
    assert container(operator)["image"] == f"{op['repository']}:{op['tag']}"


def test_values_gpu_turns_on_monitors_alerts_and_the_dashboard(
    gpu_docs: list[dict[str, Any]],
) -> None:
    assert by_kind(gpu_docs, "ServiceMonitor") and by_kind(gpu_docs, "PrometheusRule")
    dashboards = [
        d
        for d in by_kind(gpu_docs, "ConfigMap")
        if (d["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"
    ]
    assert len(dashboards) == 1


def notes(helm_bin: Path, **values: Any) -> str:
    """NOTES.txt as `helm install` prints it (rendered by a dry run, no cluster)."""
    args = ["install", "r1", str(CHART), "-n", "continuum-system", "--dry-run=client"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    out = helm(helm_bin, *args).stdout
    return out[out.index("NOTES:") :]


def test_the_notes_name_the_examples_namespace_and_how_to_see_an_operator_lead(
    helm_bin: Path,
) -> None:
    text = notes(helm_bin)
    assert "kubectl apply -f examples/namespace.yaml" in text
    lease = re.search(r"kubectl get lease -n continuum-system (\S+) -o jsonpath", text)
    assert lease is not None and lease.group(1) == "r1-continuum-leader"
    assert "deploy/r1-continuum-operator | grep 'leading as'" in text
    # Every example file the notes name exists.
    root = CHART.parents[1]
    for path in re.findall(r"-f (examples/\S+)", text):
        assert (root / path).exists(), path
    # One replica without an election has no Lease to look at, only the log.
    single = notes(helm_bin, **{"operator.replicas": 1, "operator.leaderElection.enabled": "false"})
    assert "kubectl get lease" not in single and "grep 'leading as'" in single
