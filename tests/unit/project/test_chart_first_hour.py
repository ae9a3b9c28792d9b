"""The chart as a newcomer meets it: values-gpu.yaml renders an NVIDIA cluster's install (the
agent under the nvidia RuntimeClass, GPU sharing, monitors, alerts and the dashboard, the images
it names), and NOTES.txt names the namespace the examples need and how to see an operator lead."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.kube.base.grant_settings import LeaderSettings
from continuum_operator.kube.process.leader import Elector, lead
from tests.support.fakes import FakeKubeApi
from tests.support.helm import CHART, by_kind, documents, find_helm, helm, one, template

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
    # Every replica's log, not one picked by `deploy/`: that one may be a standby's.
    selector = "-l app.kubernetes.io/instance=r1,app.kubernetes.io/component=operator"
    assert (
        f"kubectl logs -n continuum-system {selector} --prefix --tail=-1 | grep 'leading as'"
        in text
    )
    # Every example file the notes name exists.
    root = CHART.parents[1]
    for path in re.findall(r"-f (examples/\S+)", text):
        assert (root / path).exists(), path
    # One replica without an election has no Lease to look at, only the log (which says
    # `leading as` then too: test_the_log_line_the_notes_name_is_written_without_an_election).
    single = notes(helm_bin, **{"operator.replicas": 1, "operator.leaderElection.enabled": "false"})
    assert "kubectl get lease" not in single
    assert "deploy/r1-continuum-operator | grep 'leading as'" in single


def test_the_log_line_the_notes_name_is_written_without_an_election(
    helm_bin: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kube/process/leader.py logged `leading as` only when it won an election: a single replica
    without one, sent by NOTES.txt to grep for it, found nothing and looked idle."""
    single = notes(helm_bin, **{"operator.replicas": 1, "operator.leaderElection.enabled": "false"})
    wanted = re.search(r"grep '([^']+)'", single)
    assert wanted is not None
    elector = Elector(FakeKubeApi(), LeaderSettings(enabled=False), "pod-a")  # type: ignore[arg-type]

    async def run() -> int:
        stop = asyncio.Event()

        async def work(_: asyncio.Event) -> None:
            stop.set()  # the operator's loops ran: stop at once

        return await lead(elector, stop, [work])

    with caplog.at_level(logging.INFO, logger="continuum.leader"):
        assert asyncio.run(run()) == 0
    assert elector.is_leader()
    assert wanted.group(1) in caplog.text, caplog.text


def test_the_chart_readmes_quick_start_applies_only_what_a_fresh_cluster_can_take() -> None:
    """Its quick start applied examples/engines/coder-8b.yaml (namespace minds) on a cluster with
    no namespace minds, then listed the engines of the default namespace."""
    root = CHART.parents[1]
    made: set[str] = {"default"}
    problems = []
    for line in re.findall(r"^    (kubectl .*)$", (CHART / "README.md").read_text(), re.M):
        for path in re.findall(r"-f (examples/\S+)", line):
            for doc in yaml.safe_load_all((root / path).read_text()):
                if not doc:
                    continue
                if doc["kind"] == "Namespace":
                    made.add(doc["metadata"]["name"])
                ns = (doc.get("metadata") or {}).get("namespace")
                if ns and ns not in made:
                    problems.append(f"{path}: namespace {ns} is not made before `{line}`")
        if re.search(r"kubectl get engines(?!.*(-n |-A|--all-namespaces))", line):
            problems.append(f"`{line}` lists the default namespace's engines only")
    assert made != {"default"}, "the quick start applies no example any more: nothing checked"
    assert not problems, problems


def test_pull_secrets_reach_the_charts_own_pods_and_the_docs_say_the_engines_get_none(
    helm_bin: Path,
) -> None:
    """docs/install.md promised that imagePullSecrets reach the engine pods; the operator has no
    such flag and its pods run in each Engine's namespace, where the Secret does not exist."""
    from continuum_operator.cli import build_parser
    from continuum_operator.cli.operator import settings_from
    from continuum_operator.kube.workloads import engine_objects, facts_job, lane_objects
    from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
    from tests.support import builders

    docs = documents(template(helm_bin, {"imagePullSecrets": ["pull"]}).stdout)
    charts_own = [
        one(docs, "Deployment", "-operator"),
        one(docs, "DaemonSet", "-agent"),
        one(docs, "Job", "-release-finalizers"),
    ]
    for obj in charts_own:
        assert obj["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "pull"}]
    # What the operator those values run makes: no pull secret on any of its pods.
    pods = settings_from(build_parser().parse_args(container(charts_own[0])["args"])).pods
    engine, p = builders.engine_planned_on_a_gpu()
    lane = EmbedLane.model_validate(
        yaml.safe_load((CHART.parents[1] / "examples" / "embedlanes" / "notes.yaml").read_text())
    )
    placement = EmbedLanePlacement.model_validate(
        {"node": "n", "verdict": "Fits", "residence": "host", "pools": []}
    )
    made = [
        engine_objects.deployment(engine, "uid-1", p, pods, node_has_gpus=True),
        facts_job.facts_job(engine, "uid-1", pods),
        lane_objects.lane_deployment(lane, "uid-2", placement, engine, pods),
    ]
    for obj in made:
        assert "imagePullSecrets" not in obj["spec"]["template"]["spec"], obj["kind"]
    # ... and the install guide says so, and what to do instead.
    install = (CHART.parents[1] / "docs" / "install.md").read_text()
    paragraph = " ".join(install[install.index("A private registry:") :].split("\n\n")[0].split())
    assert "The engine pods pull `images.engine` too" not in paragraph
    for said in (
        "reaches the chart's own pods only",
        "get no pull secret",
        "the nodes must pull `images.engine` without one",
        "kubelet image credential provider",
    ):
        assert said in paragraph, said
