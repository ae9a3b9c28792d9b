"""The Helm chart on the real control plane: `helm install` creates valid objects, its
ServiceAccounts can do what the operator and the agent need and nothing broader (`kubectl auth
can-i` as each of them), `continuum operator` run as a local process with the chart's own
arguments and a token of the chart's ServiceAccount reconciles an Engine, and `helm upgrade`
changes a CRD. The CRDs other tests applied are adopted (`--take-ownership --force-conflicts`)
and left as they were found: the last upgrade restores the repository's CRDs, they are kept on
uninstall, and handed back to kubectl's server-side apply at the end. The
operator applies its PriorityClasses itself at every start, while the chart is installed: the
upgrades here show that the two never contend for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator import yaml_text
from continuum_operator.core.heartbeat import lease_name
from tests.support.builders import ROOT, tree
from tests.support.cluster import Cluster
from tests.support.helm import CHART, documents, find_helm, helm
from tests.support.kwok_nodes import discrete_status, renew, write_board
from tests.support.local_http import free_port
from tests.support.operator_process import engine as operator_e2e_engine
from tests.support.operator_process import scrape_metric, stop
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

GiB = 2**30

RUN = uuid.uuid4().hex[:8]
SELECTOR = ("continuum.dev/e2e-chart", RUN)
RELEASE = f"ct{RUN}"
FULLNAME = f"{RELEASE}-continuum"
OPERATOR_SA = f"{FULLNAME}-operator"
AGENT_SA = f"{FULLNAME}-agent"
MWC = "mutatingwebhookconfigurations.admissionregistration.k8s.io"
VALUES: dict[str, Any] = {
    "operator": {"engineSelector": {SELECTOR[0]: SELECTOR[1]}},
    "images": {"engine": {"repository": "continuum-engine", "tag": "e2e"}},
    # The pre-delete hook's Job never finishes here (KWOK runs no containers), so `helm
    # uninstall` would wait for it: its objects are applied and its command run as a local
    # process instead (test_the_uninstall_hooks_account_stops_the_operator_and_frees_minds).
    "uninstall": {"releaseFinalizers": False},
}


@dataclass
class Release:
    helm: Path
    namespace: str
    values_file: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return helm(self.helm, *args, env=self.env, check=check, timeout=600)


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """The chart installed in its own namespace; uninstalled (and the namespace deleted) after."""
    binary = find_helm()
    ns = f"continuum-{RUN}"
    values = tmp_path_factory.mktemp("chart") / "values.yaml"
    values.write_text(yaml_text.dump(VALUES))
    rel = Release(binary, ns, values, cluster.env)
    rel.run(
        "install", RELEASE, str(CHART), "--namespace", ns, "--create-namespace",
        # CRDs other tests applied with `kubectl apply --server-side` are adopted. Helm's apply of
        # them conflicts with kubectl's on .spec.versions (an atomic list kubectl owns) unless
        # forced: the API server drops the CRDs' empty `properties: {}`, so the stored list never
        # equals the applied one (charts/continuum/README.md, "Adopting CRDs").
        "-f", str(values), "--take-ownership", "--force-conflicts",
    )  # fmt: skip
    try:
        yield rel
    finally:
        rel.run("uninstall", RELEASE, "--namespace", ns, "--wait", check=False)
        cluster.kubectl(
            "delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False
        )
        # Handed back to kubectl as found, for the tests that apply them after this one.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))


def can_i(cluster: Cluster, sa: str, ns: str, *args: str) -> bool:
    proc = cluster.kubectl(
        "auth", "can-i", *args, f"--as=system:serviceaccount:{ns}:{sa}", check=False
    )
    answer = proc.stdout.strip()
    assert answer in {"yes", "no"}, f"kubectl auth can-i {args}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


# --------------------------------------------------------------------------------------------


def test_install_creates_every_object_of_the_manifest(cluster: Cluster, release: Release) -> None:
    manifest = documents(release.run("get", "manifest", RELEASE, "-n", release.namespace).stdout)
    assert {d["kind"] for d in manifest} >= {
        "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "ServiceAccount", "Deployment", "DaemonSet", "Service",
    }  # fmt: skip
    for doc in manifest:
        args = [doc["kind"], doc["metadata"]["name"]]
        ns = doc["metadata"].get("namespace")
        live = cluster.get_json(*args, *(["-n", ns] if ns else []))
        assert live["metadata"]["name"] == doc["metadata"]["name"]
    for crd in (d for d in manifest if d["kind"] == "CustomResourceDefinition"):
        live = cluster.get_json("crd", crd["metadata"]["name"])
        assert live["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        established = [c for c in live["status"]["conditions"] if c["type"] == "Established"]
        assert established and established[0]["status"] == "True"
    deployment = cluster.get_json("deployment", f"{FULLNAME}-operator", "-n", release.namespace)
    assert deployment["spec"]["replicas"] == 2
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa == OPERATOR_SA


def test_the_api_server_puts_the_grant_finalizer_on_a_mind_as_she_is_created(
    cluster: Cluster, release: Release
) -> None:
    """The chart's MutatingAdmissionPolicy: the finalizer comes with the create, so the
    operator does not write it at her grant (docs/grants.md, "Finalizers"); a finalizer of
    her own is kept beside it."""
    mind: dict[str, Any] = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": "finalized", "namespace": release.namespace,
                     "finalizers": ["example.com/mine"]},
        "spec": {"engine": "nowhere", "contextTokens": 256},
    }  # fmt: skip

    def created() -> Any:
        proc = cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-",
            input=yaml_text.dump(mind), check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            return None
        finalizers = json.loads(proc.stdout)["metadata"].get("finalizers")
        return finalizers if "continuum.dev/grant" in finalizers else None

    # The policy reaches the admission chain a moment after it is created.
    finalizers = wait_for("the finalizer added at admission", created, 60, None)
    assert finalizers == ["example.com/mine", "continuum.dev/grant"]
    del mind["metadata"]["finalizers"]
    assert wait_for("the finalizer added at admission", created, 60, None) == [
        "continuum.dev/grant"
    ]


def test_the_operators_service_account_can_do_its_work_and_nothing_broader(
    cluster: Cluster, release: Release
) -> None:
    ns = release.namespace
    yes = [
        ("create", MWC),
        ("patch", f"{MWC}/continuum-mind-children"),
        ("list", "engines.continuum.dev", "--all-namespaces"),
        ("watch", "minds.continuum.dev", "--all-namespaces"),
        ("patch", "engines.continuum.dev", "--subresource=status", "-n", "any-ns"),
        # The grant ledgers: made at an Engine's first step, their status replaced, a stale one
        # deleted on its uid.
        ("watch", "grantledgers.continuum.dev", "--all-namespaces"),
        ("create", "grantledgers.continuum.dev", "-n", "any-ns"),
        ("update", "grantledgers.continuum.dev", "--subresource=status", "-n", "any-ns"),
        ("delete", "grantledgers.continuum.dev", "-n", "any-ns"),
        ("patch", "minds.continuum.dev", "-n", "any-ns"),
        ("patch", "embedlanes.continuum.dev", "--subresource=status", "-n", "any-ns"),
        ("watch", "tokenquotas.continuum.dev", "--all-namespaces"),
        ("patch", "tokenquotas.continuum.dev", "--subresource=status", "-n", "any-ns"),
        ("list", "nodeboards.continuum.dev"),
        ("list", "leases.coordination.k8s.io", "--all-namespaces"),
        ("create", "deployments.apps", "-n", "any-ns"),
        ("delete", "services", "-n", "any-ns"),
        ("create", "jobs.batch", "-n", "any-ns"),
        ("get", "pods", "--subresource=log", "-n", "any-ns"),
        ("create", "roles.rbac.authorization.k8s.io", "-n", "any-ns"),
        ("create", "events", "-n", "any-ns"),
        ("patch", "priorityclasses.scheduling.k8s.io"),
        ("create", "leases.coordination.k8s.io", "-n", ns),
        ("update", f"leases.coordination.k8s.io/{FULLNAME}-leader", "-n", ns),
        # Each engine's ServiceAccount bound to system:auth-delegator (its gateway reviews
        # tokens): the operator creates the binding, and may bind that one role only (below).
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("bind", "clusterroles.rbac.authorization.k8s.io/system:auth-delegator"),
    ]
    no = [
        ("get", "secrets", "-n", ns),
        ("list", "secrets", "--all-namespaces"),
        ("create", "engines.continuum.dev", "-n", "any-ns"),
        ("update", "engines.continuum.dev", "--subresource=status", "-n", "any-ns"),  # patches
        ("patch", "grantledgers.continuum.dev", "-n", "any-ns"),
        ("delete", "minds.continuum.dev", "-n", "any-ns"),
        ("patch", "tokenquotas.continuum.dev", "-n", "any-ns"),
        ("create", "tokenquotas.continuum.dev", "-n", "any-ns"),
        ("patch", "nodeboards.continuum.dev", "--subresource=status"),
        ("delete", "nodes"),
        ("create", "pods", "-n", "any-ns"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("delete", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin"),
        ("update", "leases.coordination.k8s.io/kube-controller-manager", "-n", "kube-system"),
        ("update", "leases.coordination.k8s.io/someone-else", "-n", ns),
        # The children's webhook is on by default: its own configuration only, never another's.
        ("patch", f"{MWC}/someone-elses"),
        ("delete", MWC),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
        ("impersonate", "serviceaccounts", "-n", ns),
    ]
    for args in yes:
        assert can_i(cluster, OPERATOR_SA, ns, *args), f"operator should: {args}"
    for args in no:
        assert not can_i(cluster, OPERATOR_SA, ns, *args), f"operator should not: {args}"
    # Tried: a binding of any other cluster role is refused by the API server's escalation check.
    as_operator = f"--as=system:serviceaccount:{ns}:{OPERATOR_SA}"
    for role, allowed in (("cluster-admin", False), ("system:auth-delegator", True)):
        proc = cluster.kubectl(
            "create", "clusterrolebinding", f"e2e-try-{release.namespace}", f"--clusterrole={role}",
            f"--serviceaccount={ns}:default", "--dry-run=server", as_operator, check=False,
        )  # fmt: skip
        assert (proc.returncode == 0) is allowed, (role, proc.stdout, proc.stderr)
        if not allowed:
            assert "forbidden" in proc.stderr, proc.stderr


def test_the_agents_service_account_writes_only_boards_and_node_leases(
    cluster: Cluster, release: Release
) -> None:
    ns = release.namespace
    yes = [
        ("get", "nodes"),
        ("get", "nodeboards.continuum.dev"),
        ("create", "nodeboards.continuum.dev"),
        ("patch", "nodeboards.continuum.dev", "--subresource=status"),
        # Its node Lease in the release namespace (which one: the agent-node-binding policy).
        ("create", "leases.coordination.k8s.io", "-n", ns),
        ("patch", "leases.coordination.k8s.io", "-n", ns),
    ]
    no = [
        ("patch", "nodes"),
        ("delete", "nodeboards.continuum.dev"),
        ("patch", "engines.continuum.dev", "--subresource=status", "-n", "any-ns"),
        ("create", "leases.coordination.k8s.io", "-n", "kube-node-lease"),  # the kubelets'
        ("patch", "leases.coordination.k8s.io", "-n", "kube-node-lease"),
        ("patch", "leases.coordination.k8s.io", "-n", "kube-system"),
        ("get", "secrets", "-n", ns),
        # No pods at all: its board's spec names its node's engine and lane pods.
        ("list", "pods", "--all-namespaces"),
        ("get", "pods", "-n", "any-ns"),
        ("get", "pods", "--subresource=log", "-n", "any-ns"),
        ("create", "pods", "-n", ns),
    ]
    for args in yes:
        assert can_i(cluster, AGENT_SA, ns, *args), f"agent should: {args}"
    for args in no:
        assert not can_i(cluster, AGENT_SA, ns, *args), f"agent should not: {args}"


def test_the_agent_with_the_charts_arguments_and_service_account_writes_a_board_and_lease(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    """One cycle of `continuum agent` as the DaemonSet runs it, less what only a pod has
    (`--in-cluster`, the host's cgroup mount), authenticated as the chart's agent."""
    ns = release.namespace
    ds = cluster.get_json("daemonset", f"{FULLNAME}-agent", "-n", ns)
    args = [
        a
        for a in ds["spec"]["template"]["spec"]["containers"][0]["args"]
        if a != "--in-cluster" and not a.startswith(("--cgroup-root=", "--cgroup-dir="))
    ]
    assert args[0] == "agent"
    node = f"chart-agent-{RUN}"
    cluster.create_fake_node(node)
    # The token of a pod on the node, as the DaemonSet's pod has: the agent-node-binding policy
    # reads the node from it (a token bound to no pod writes no board).
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"agent-{RUN}", "namespace": ns},
            "spec": {
                "nodeName": node,
                "serviceAccountName": AGENT_SA,
                "containers": [{"name": "agent", "image": "continuum-agent:e2e"}],
            },
        }
    )
    kubeconfig = _token_kubeconfig(
        cluster, ns, AGENT_SA, tmp_path / "agent.kubeconfig", bound_pod=f"agent-{RUN}"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "continuum_operator.cli", *args,
             "--once", "--node-name", node, "--kubeconfig", str(kubeconfig)],
            capture_output=True, text=True, timeout=180, check=False,
            env={**cluster.env, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        board = cluster.get_json("nodeboard", node)
        assert board["status"]["memoryMode"] in {"unified", "discrete", "unknown"}
        assert board["status"]["pools"]
        lease = cluster.get_json("lease", lease_name(node), "-n", ns)  # the release's
        assert lease["spec"]["leaseDurationSeconds"] == 40  # the chart's agent.leaseSeconds
    finally:
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)
        cluster.kubectl("delete", "nodeboard", node, "--wait=false", check=False)


def _token_kubeconfig(
    cluster: Cluster, ns: str, sa: str, path: Path, bound_pod: str | None = None
) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a bound token)."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx_name = admin["current-context"]
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == ctx_name)
    server = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    bound = ["--bound-object-kind=Pod", f"--bound-object-name={bound_pod}"] if bound_pod else []
    token = cluster.kubectl(
        "create", "token", sa, "-n", ns, "--duration=1h", *bound
    ).stdout.strip()  # fmt: skip
    path.write_text(
        yaml_text.dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": server["cluster"]}],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": "c", "user": sa}}],
                "current-context": "sa",
            }
        )
    )
    return path


def test_the_operator_with_the_charts_arguments_and_service_account_reconciles_an_engine(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    ns = release.namespace
    deployment = cluster.get_json("deployment", f"{FULLNAME}-operator", "-n", ns)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    # The children's webhook (on by default) serves with the certificate mounted in the pod:
    # tested on its own (test_the_webhooks_certificate_is_made_once_and_kept_across_upgrades).
    args = [
        f"--metrics-port={port}" if a.startswith("--metrics-port=") else a
        for a in container["args"]
        if not a.startswith("--webhook")
    ]
    assert args[0] == "operator"
    kubeconfig = _token_kubeconfig(cluster, ns, OPERATOR_SA, tmp_path / "sa.kubeconfig")
    log = tmp_path / "operator.log"
    cmd = [sys.executable, "-m", "continuum_operator.cli", *args, "--kubeconfig", str(kubeconfig)]
    env = {**cluster.env, "POD_NAMESPACE": ns, "KUBECONFIG": str(kubeconfig)}

    node = f"chart-{RUN}"
    cluster.create_fake_node(node, capacity={"nvidia.com/gpu": "1"}, labels={"e2e-chart": RUN})
    write_board(cluster, node, discrete_status(80, 1))
    renew(cluster, node, namespace=ns)  # the agents' Leases are in the release namespace
    stale = f"chart-stale-{RUN}"
    cluster.create_fake_node(stale, labels={"e2e-chart-stale": RUN})
    write_board(cluster, stale, discrete_status(24, 1))
    renew(cluster, stale, renew_time="2020-01-01T00:00:00.000000Z", ttl=40, namespace=ns)
    engine = operator_e2e_engine(
        "chart-engine",
        RUN,
        minds={"min": 1, "max": 4},
        placement={"nodeSelector": {"e2e-chart": RUN}},
    )
    # The chart's operator serves Engines of its selector, in the release's namespace.
    engine["metadata"] = {"name": "chart-engine", "namespace": ns, "labels": dict([SELECTOR])}
    cluster.apply(engine)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        time.sleep(3)
        if proc.poll() is not None:
            pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)

        def placed() -> Any:
            body = cluster.get_json("engine", "chart-engine", "-n", ns)
            status = body.get("status") or {}
            return body if (status.get("placement") or {}).get("node") == node else None

        body = wait_for("the Engine placed on the chart's test node", placed, 120, log)
        plan = body["status"]["plan"]
        assert plan["layersOnDevice"] == plan["totalLayers"]  # 80 GiB holds every layer
        # Its pod's identity and workload, written with the chart's RBAC (a Role the API server
        # lets the operator create only because the operator holds every right in it).
        wait_for(
            "the engine's Deployment",
            lambda: cluster.kubectl("get", "deployment", "chart-engine", "-n", ns, check=False)
            .returncode == 0,
            120,
            log,
        )  # fmt: skip
        role = cluster.get_json("role", "continuum-engine-chart-engine", "-n", ns)
        assert role["rules"][0]["resourceNames"] == ["chart-engine"]
        # The leader Lease the chart's Role allows, held by this process.
        lease = wait_for(
            "the leader Lease",
            lambda: (
                cluster.kubectl(
                    "get", "lease", f"{FULLNAME}-leader", "-n", ns, "-o", "json", check=False
                ).stdout
            ),
            60,
            log,
        )
        assert json.loads(lease)["spec"]["holderIdentity"]
        # Its metrics, on the chart's port setting replaced by a free one.
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(
            "continuum_node_board_fresh for the node",
            lambda: scrape_metric(url, "continuum_node_board_fresh", node=node) == 1.0,
            60,
            log,
        )
        assert (scrape_metric(url, "continuum_engine_placements_total") or 0) >= 1
        assert scrape_metric(url, "continuum_node_board_fresh", node=stale) == 0.0
        # The pools as the board says and the placement leases (docs/metrics.md).
        device = {"node": node, "pool": "device/0"}
        assert scrape_metric(url, "continuum_pool_capacity_bytes", **device) == 80 * GiB
        assert scrape_metric(url, "continuum_pool_used_bytes", **device) == 1 * GiB
        leased = {p["pool"]: p["bytes"] for p in body["status"]["placement"]["pools"]}
        assert leased["device/0"] > 0
        assert (
            scrape_metric(url, "continuum_pool_leased_bytes", **device, consumer_kind="Engine")
            == leased["device/0"]
        )
        assert scrape_metric(url, "continuum_pool_available_bytes", **device) == 80 * GiB - max(
            leased["device/0"], 1 * GiB
        )
        assert scrape_metric(url, "continuum_node_memory_mode", node=node, mode="discrete") == 1.0
        assert (
            scrape_metric(
                url, "continuum_engine_memory_mode_unknown", namespace=ns, engine="chart-engine"
            )
            == 0.0
        )
        text = log.read_text()
        assert "403" not in text and "Forbidden" not in text and "forbidden" not in text, text[
            -3000:
        ]
    finally:
        stop(proc, timeout=30)
        cluster.kubectl("delete", "engine", "chart-engine", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "node", node, stale, "--wait=false", check=False)


def test_the_uninstall_hooks_account_stops_the_operator_and_frees_minds(
    cluster: Cluster, release: Release, namespace: str, tmp_path: Path
) -> None:
    """The pre-delete hook's objects as the chart renders them (the Job aside), and its
    command, `continuum release-finalizers` with the Job's arguments, run as a local process
    with a token of the hook's ServiceAccount: its rights are enough to stop the chart's
    operator and take the grant finalizer off a Mind stuck Terminating in another namespace."""
    ns = release.namespace
    rendered = release.run(
        "template", RELEASE, str(CHART), "-n", ns, "-f", str(release.values_file),
        "--set", "uninstall.releaseFinalizers=true",
        "--show-only", "templates/uninstall-hook.yaml",
    ).stdout  # fmt: skip
    hook = documents(rendered)
    job = next(d for d in hook if d["kind"] == "Job")
    rights = [d for d in hook if d["kind"] != "Job"]
    sa = next(d for d in hook if d["kind"] == "ServiceAccount")["metadata"]["name"]
    cluster.apply(rights)
    mind = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {
            "name": "stuck",
            "namespace": namespace,
            "finalizers": ["continuum.dev/grant"],
        },
        "spec": {"engine": "coder", "contextTokens": 4096},
    }
    try:
        cluster.apply(mind)
        cluster.kubectl("delete", "mind", "stuck", "-n", namespace, "--wait=false")
        kubeconfig = _token_kubeconfig(cluster, ns, sa, tmp_path / "hook.kubeconfig")
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "release-finalizers"
        proc = subprocess.run(
            [sys.executable, "-m", "continuum_operator.cli", *args,
             "--kubeconfig", str(kubeconfig)],
            capture_output=True, text=True, timeout=300, check=False,
            env={**cluster.env, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        operator = cluster.get_json("deployment", f"{FULLNAME}-operator", "-n", ns)
        assert operator["spec"]["replicas"] == 0
        gone = cluster.kubectl("get", "mind", "stuck", "-n", namespace, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
        # And nothing broader than that: no Mind deletions, no other Deployment.
        assert not can_i(cluster, sa, namespace, "delete", "minds.continuum.dev")
        assert not can_i(cluster, sa, ns, "patch", "deployments/other")
    finally:
        cluster.kubectl(
            "patch", "mind", "stuck", "-n", namespace, "--type=merge",
            "-p", '{"metadata":{"finalizers":[]}}', check=False,
        )  # fmt: skip
        for doc in rights:
            kind, name = doc["kind"].lower(), doc["metadata"]["name"]
            where = ["-n", ns] if doc["metadata"].get("namespace") else []
            cluster.kubectl("delete", kind, name, *where, "--ignore-not-found", check=False)


def test_an_upgrade_changes_a_crd_and_the_operator_and_keeps_crds_on_uninstall(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    ns = release.namespace
    changed = tmp_path / "continuum"
    subprocess.run(["cp", "-r", str(CHART), str(changed)], check=True)
    crd_file = changed / "files" / "crds" / "continuum.dev_minds.yaml"
    text = crd_file.read_text()
    column = (
        "    additionalPrinterColumns:\n"
        "    - name: Upgraded\n"
        "      type: string\n"
        "      jsonPath: .metadata.labels.upgraded\n"
    )
    marker = "  - name: v1alpha1\n"
    assert marker in text
    had_columns = "additionalPrinterColumns:" in text
    if had_columns:
        text = text.replace(
            "    additionalPrinterColumns:\n",
            "    additionalPrinterColumns:\n"
            "    - name: Upgraded\n      type: string\n      jsonPath: .metadata.labels.upgraded\n",
            1,
        )
    else:
        text = text.replace(marker, marker + column, 1)
    crd_file.write_text(text)

    def columns() -> list[str]:
        crd = cluster.get_json("crd", "minds.continuum.dev")
        return [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns", [])]

    before = columns()
    assert "Upgraded" not in before
    release.run(
        "upgrade", RELEASE, str(changed), "-n", ns, "-f", str(release.values_file),
        "--set", "operator.replicas=3",
        # kubectl (other tests' applies) co-owns the adopted CRDs' .spec.versions: changing it
        # takes a forced apply. A release whose CRDs only Helm applied needs none.
        "--force-conflicts",
    )  # fmt: skip
    assert "Upgraded" in columns()
    assert cluster.get_json("deployment", f"{FULLNAME}-operator", "-n", ns)["spec"]["replicas"] == 3
    history = release.run("history", RELEASE, "-n", ns, "-o", "json").stdout
    assert [h["revision"] for h in json.loads(history)] == [1, 2]

    # Back to the repository's CRDs (other tests apply them), then uninstall.
    release.run(
        "upgrade", RELEASE, str(CHART), "-n", ns, "-f", str(release.values_file),
        "--force-conflicts",
    )  # fmt: skip
    assert columns() == before
    release.run("uninstall", RELEASE, "-n", ns, "--wait")
    for crd in ("engines", "minds", "embedlanes", "nodeboards", "mindclasses"):
        cluster.get_json("crd", f"{crd}.continuum.dev")  # kept
    # The operator's own PriorityClasses (applied by it, not the chart) outlive the release.
    cluster.get_json("priorityclass", "continuum-mind-children")
    gone = cluster.kubectl(
        "get", "clusterrole", f"{FULLNAME}-operator", "--ignore-not-found", "-o", "name"
    )
    assert gone.stdout.strip() == ""
    gone = cluster.kubectl(
        "get", "deployment", f"{FULLNAME}-operator", "-n", ns, "--ignore-not-found", "-o", "name"
    )
    assert gone.stdout.strip() == ""


def test_the_webhooks_certificate_is_made_once_and_kept_across_upgrades(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A second release with the webhook on (CRDs and agent off): Helm makes a CA and a serving
    certificate for the webhook's Service at install (a `lookup` on the live cluster), and an
    upgrade keeps them, so every replica and the API server go on agreeing on one bundle."""
    binary = find_helm()
    ns = f"continuum-wh-{RUN}"
    name = f"wh{RUN}"
    rel = Release(binary, ns, tmp_path / "values.yaml", cluster.env)
    rel.values_file.write_text(
        yaml_text.dump(
            {
                "crds": {"install": False},
                "agent": {"enabled": False},
                "webhook": {"enabled": True},
                "uninstall": {"releaseFinalizers": False},  # see VALUES
            }
        )
    )
    rel.run(
        "install", name, str(CHART), "-n", ns, "--create-namespace", "-f", str(rel.values_file)
    )  # fmt: skip
    try:
        secret = f"{name}-continuum-webhook-tls"
        first = cluster.get_json("secret", secret, "-n", ns)["data"]
        assert set(first) == {"ca.crt", "tls.crt", "tls.key"}
        service = cluster.get_json("service", f"{name}-continuum-webhook", "-n", ns)
        assert service["spec"]["ports"][0]["port"] == 9443
        sa = f"{name}-continuum-operator"
        wh = "mutatingwebhookconfigurations.admissionregistration.k8s.io"
        assert can_i(cluster, sa, ns, "create", wh)
        assert can_i(cluster, sa, ns, "patch", f"{wh}/continuum-mind-children")
        assert not can_i(cluster, sa, ns, "patch", f"{wh}/someone-elses")
        assert not can_i(cluster, sa, ns, "delete", f"{wh}/continuum-mind-children")

        # The configuration the operator installs with the chart's arguments names the Service
        # (no cluster DNS needed) with the chart's CA: the API server takes it (a server-side
        # dry run, which validates it as a create would).
        from continuum_operator.cli import build_parser
        from continuum_operator.cli.operator import settings_from
        from continuum_operator.kube.children import webhook

        deployment = cluster.get_json("deployment", f"{name}-continuum-operator", "-n", ns)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        children = settings_from(build_parser().parse_args(args)).children
        config = tree(
            webhook.webhook_configuration(
                {"url": "https://unused", "caBundle": first["ca.crt"]}, children
            )
        )
        config["metadata"]["name"] = f"dry-run-{RUN}"
        accepted = yaml.safe_load(cluster.apply(config, "--dry-run=server", "-o", "yaml"))[
            "webhooks"
        ][0]["clientConfig"]
        assert accepted["service"] == {
            "namespace": ns,
            "name": service["metadata"]["name"],
            "port": 9443,
            "path": f"/{webhook.HANDLER_ID}",
        }
        assert "url" not in accepted

        def generation() -> int:
            deployment = cluster.get_json("deployment", f"{name}-continuum-operator", "-n", ns)
            return int(deployment["metadata"]["generation"])

        before = generation()
        rel.run("upgrade", name, str(CHART), "-n", ns, "-f", str(rel.values_file))
        assert cluster.get_json("secret", secret, "-n", ns)["data"] == first
        # Nothing changed, so the operator's pods do not roll (a new certificate would not roll
        # them either: the operator re-reads the mounted files).
        assert generation() == before
    finally:
        rel.run("uninstall", name, "-n", ns, "--wait", check=False)
        cluster.kubectl(
            "delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False
        )
