"""Trust boundaries on the real API server (docs/security.md): each boundary checked as the party
it limits (`kubectl --as`, `kubectl auth can-i`), and the refusal read for the rule it names.

One section per boundary, in the order of docs/security.md. The chart's objects are rendered by
`helm template` (tests/support/helm.py) and applied into each test's own namespace; cluster-wide
ones carry a release name of their own and are deleted when the test ends."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator import yaml_text
from continuum_operator.core.heartbeat import NODE_ANNOTATION, lease_name, node_of_lease
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.children.membership import BACKGROUND, CLASS_ANNOTATION, MIND_LABEL
from continuum_operator.kube.process.leader import WALL_CLOCK_OFFSET_ENV
from continuum_operator.kube.workloads import (
    engine_identity,
    engine_objects,
    facts_job,
    lane_objects,
)
from continuum_operator.kube.workloads.priority_classes import priority_classes
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from continuum_operator.model.engine import Engine
from tests.support import builders
from tests.support.admission_policies import (
    EDITOR,
    SCOPE,
    install_checked,
    installed,
    kubectl_as,
    namespace_editor,
    policies,
    refused_once_active,
    scoped_namespace,
    tag,
    type_checked,
)
from tests.support.cluster import Cluster
from tests.support.crash_scenario import scenario, settled
from tests.support.crds import crds
from tests.support.grant_ledger import assert_no_grant_doubled, serving
from tests.support.grants_operator import start_operator
from tests.support.helm import documents, find_helm, one, template
from tests.support.kwok_nodes import fresh_gpu_node as grants_gpu_node
from tests.support.local_http import free_port
from tests.support.mind_specs import engine as grants_engine
from tests.support.mind_specs import mind_class
from tests.support.operator_process import stop
from tests.support.waiting import wait_for
from tests.support.webhook_operator import WEBHOOK, wait_ready
from tests.support.webhook_operator import operator as webhook_operator
from tests.support.webhook_operator import pod as child_pod

pytestmark = pytest.mark.e2e

__all__ = ["crds", "installed", "tag"]  # fixtures, used by name

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def refused(proc: subprocess.CompletedProcess[str]) -> str:
    """The API server's refusal of a kubectl call that must fail."""
    assert proc.returncode != 0, f"expected a refusal, got: {proc.stdout}"
    return proc.stderr


def can(cluster: Cluster, user: str, verb: str, resource: str, ns: str, *more: str) -> bool:
    """`kubectl auth can-i` as `user`."""
    answer = kubectl_as(cluster, user, "auth", "can-i", verb, resource, "-n", ns, *more)
    return answer.stdout.strip() == "yes"


def engine_body(name: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {
        "facts": {"layers": 4, "layerBytes": 2**20, "inputBytes": 2**20,
                  "kvBytesPerTokenPerLayer": 4096},
    }  # fmt: skip
    if source is not None:
        model["source"] = source
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"name": name},
        "spec": {"model": model, "contextTokensPerMind": 1024},
    }


# ============================================================================================
# Engine model sources (docs/security.md "Engine model sources")


def test_a_namespace_editors_engine_with_a_host_path_of_root_is_refused_by_the_api_server(
    cluster: Cluster,
    crds: None,
    tag: str,
    installed: Callable[[list[dict[str, Any]]], None],
) -> None:
    ns = scoped_namespace(cluster, tag)
    namespace_editor(cluster, ns)
    assert can(cluster, EDITOR, "create", "engines.continuum.dev", ns)
    assert not can(cluster, EDITOR, "patch", "engines.continuum.dev", ns, "--subresource=status")
    assert not can(cluster, EDITOR, "create", "engines.continuum.dev", "default")
    docs = policies(
        {"engineSources": {"allowedHostPathPrefixes": ["/srv/models"],
                           "policy": {"namespaceSelector": {"matchLabels": {SCOPE: tag}}}}},
        "-engine-sources",
    )  # fmt: skip
    install_checked(cluster, installed, docs)

    def create(body: dict[str, Any], dry_run: bool = True) -> subprocess.CompletedProcess[str]:
        args = ["create", "-f", "-", "-n", ns, *(["--dry-run=server"] if dry_run else [])]
        return kubectl_as(cluster, EDITOR, *args, input=json.dumps(body))

    root = engine_body("root", {"kind": "hostPath", "path": "/"})
    denied = refused_once_active(lambda: create(root), "the hostPath / refused")
    for words in (
        "ValidatingAdmissionPolicy 'e2e-continuum-engine-sources'",
        "spec.model.source.path: hostPath / is not under a directory the cluster admin allows",
        "(/srv/models/)",
        "chart value engineSources.allowedHostPathPrefixes",
    ):
        assert words in denied.stderr, denied.stderr
    for path in ("/etc/kubernetes/admin.conf", "/srv/models-evil/m.gguf", "/srv/models"):
        body = engine_body("climb", {"kind": "hostPath", "path": path})
        assert create(body).returncode != 0, path
    # An EmbedLane's own model is held to the same directories.
    lane = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "EmbedLane",
        "metadata": {"name": "lane"},
        "spec": {"maxContextTokens": 512,
                 "model": engine_body("x", {"kind": "hostPath", "path": "/"})["spec"]["model"]},
    }  # fmt: skip
    assert "hostPath / is not under" in create(lane).stderr
    # Inside the admin's directory, and sources that are not the host's, are admitted.
    inside = engine_body("inside", {"kind": "hostPath", "path": "/srv/models/m.gguf"})
    made = create(inside, dry_run=False)
    assert made.returncode == 0, made.stderr
    pvc = engine_body("pvc", {"kind": "pvc", "claimName": "models", "path": "m.gguf"})
    assert create(pvc).returncode == 0
    # An update that moves an admitted source out of the directory is refused too.
    moved = kubectl_as(
        cluster, EDITOR, "patch", "engine", "inside", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"model": {"source": {"path": "/etc/shadow"}}}}),
    )  # fmt: skip
    assert moved.returncode != 0 and "hostPath /etc/shadow is not under" in moved.stderr
    # The API server also refuses facts that would plan a pool of free KV cells.
    zero = engine_body("zero")
    zero["spec"]["model"]["facts"]["kvBytesPerTokenPerLayer"] = 0
    refused_zero = create(zero)
    assert refused_zero.returncode != 0
    assert "kvBytesPerTokenPerLayer" in refused_zero.stderr
    assert "greater than or equal to 1" in refused_zero.stderr


def test_a_minds_childs_cpu_cannot_be_resized_in_place_but_its_memory_can(
    cluster: Cluster,
    crds: None,
    tag: str,
    installed: Callable[[list[dict[str, Any]]], None],
) -> None:
    """docs/children.md: the children's webhook leaves a mind's child the least CPU weight;
    an in-place resize (pods/resize, on by default since Kubernetes 1.33) would give it back.
    Found by review: the webhook only sees a pod's creation."""
    ns = scoped_namespace(cluster, tag)
    selector = {"namespaceSelector": {"matchLabels": {SCOPE: tag}}}
    docs = policies({"webhook": {"cpuResizePolicy": selector}}, "-children-cpu")
    install_checked(cluster, installed, docs)
    child_class = PodSettings().children_priority_class
    cluster.apply(
        [c for c in priority_classes(PodSettings()) if c["metadata"]["name"] == child_class]
    )

    def pod(name: str, priority_class: str | None) -> dict[str, Any]:
        container = {"name": "c", "image": "busybox",
                     "resources": {"requests": {"cpu": "1m", "memory": "64Mi"}}}  # fmt: skip
        spec: dict[str, Any] = {"containers": [container]}
        if priority_class:
            spec["priorityClassName"] = priority_class
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    cluster.apply([pod("child", child_class), pod("other", None)], "-n", ns)

    def resize(name: str, resources: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        patch = {"spec": {"containers": [{"name": "c", "resources": resources}]}}
        return cluster.kubectl("patch", "pod", name, "-n", ns, "--subresource=resize",
                               "--type=strategic", "-p", json.dumps(patch), "--dry-run=server",
                               check=False)  # fmt: skip

    more_cpu = {"requests": {"cpu": "2"}}
    denied = refused_once_active(
        lambda: resize("child", more_cpu), "the child's CPU resize refused"
    )
    for words in ("ValidatingAdmissionPolicy 'e2e-continuum-children-cpu'",
                  "pod child is a mind's child", "resize its memory only"):  # fmt: skip
        assert words in denied.stderr, denied.stderr
    assert resize("child", {"limits": {"cpu": "4"}}).returncode != 0  # a limit is CPU too
    more_memory = resize("child", {"requests": {"memory": "128Mi"}})
    assert more_memory.returncode == 0, more_memory.stderr
    other = resize("other", more_cpu)  # a pod of another class: not the policy's
    assert other.returncode == 0, other.stderr


def _dry_run_pod(
    cluster: Cluster, ns: str, spec: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """The pod `spec` as its controller would create it, judged by Pod Security admission."""
    spec = copy.deepcopy(spec)
    spec.pop("priorityClassName", None)  # the operator installs it; not the boundary here
    spec["serviceAccountName"] = "default"
    spec.pop("affinity", None)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": spec}
    return cluster.kubectl(
        "create", "-f", "-", "-n", ns, "--dry-run=server", input=json.dumps(pod), check=False
    )


def test_engine_facts_and_lane_pods_are_admitted_where_the_restricted_profile_is_enforced(
    cluster: Cluster, tag: str
) -> None:
    ns = scoped_namespace(cluster, tag, **{"pod-security.kubernetes.io/enforce": "restricted"})
    engine = Engine.model_validate(
        {**engine_body("coder", {"kind": "pvc", "claimName": "models", "path": "m.gguf"}),
         "metadata": {"name": "coder", "namespace": ns}}
    )  # fmt: skip
    pods = PodSettings()
    plan = builders.plan_on_a_gpu(node="n1", gpus=(0,), engine_args=("--ctx-size", "1024"))
    deployment = engine_objects.deployment(engine, "uid", plan, pods, node_has_gpus=True)
    job = facts_job.facts_job(engine, "uid", pods)
    lane = EmbedLane.model_validate(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": "notes", "namespace": ns},
         "spec": {"maxContextTokens": 512, "engine": "coder"}}
    )  # fmt: skip
    placement = EmbedLanePlacement.model_validate(
        {"verdict": "Fits", "residence": "host", "node": "n1", "pools": []}
    )
    lane_deployment = lane_objects.lane_deployment(lane, "uid", placement, engine, pods)
    for what, body in (("engine", deployment), ("facts", job), ("lane", lane_deployment)):
        admitted = _dry_run_pod(cluster, ns, body["spec"]["template"]["spec"])
        assert admitted.returncode == 0, (what, admitted.stderr)
    # The profile is enforced here: the same pod without its securityContext is refused.
    bare = copy.deepcopy(deployment["spec"]["template"]["spec"])
    bare.pop("securityContext")
    for c in bare["containers"]:
        c.pop("securityContext")
    denied = _dry_run_pod(cluster, ns, bare)
    assert denied.returncode != 0 and 'violates PodSecurity "restricted' in denied.stderr


# ============================================================================================
# The ledger: written by the operator alone (docs/security.md "The ledger")


def test_an_engine_service_account_reads_its_ledger_and_writing_it_is_refused_by_rbac(
    cluster: Cluster, crds: None, tag: str
) -> None:
    ns = scoped_namespace(cluster, tag)
    body = engine_body("coder", {"kind": "pvc", "claimName": "models", "path": "m.gguf"})
    cluster.apply(body, "-n", ns)
    made = cluster.get_json("engine", "coder", "-n", ns)
    engine = Engine.model_validate(made)
    cluster.apply(engine_identity.engine_rbac(engine, made["metadata"]["uid"]))
    cluster.apply(engine_body("other"), "-n", ns)
    # The ledgers as the operator makes and writes them (the test's admin stands in for it).
    ledger = {"grants": [{"mind": f"{ns}/ann", "state": "Granted", "tokens": 1024}],
              "grantStep": {"seq": 3, "t": "2026-12-03T06:00:00Z", "lines": []}}  # fmt: skip
    for name in ("coder", "other"):
        cluster.apply(
            {"apiVersion": "continuum.dev/v1alpha1", "kind": "GrantLedger",
             "metadata": {"name": name, "namespace": ns}},
        )  # fmt: skip
        cluster.kubectl(
            "patch", "grantledger", name, "-n", ns, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": ledger}),
        )  # fmt: skip

    sa = f"system:serviceaccount:{ns}:{engine_objects.service_account_name(engine)}"
    # Its gateway reads its own ledger (a watch, by name), no other, and writes none.
    mine = kubectl_as(cluster, sa, "get", "grantledger", "coder", "-n", ns, "-o", "json")
    assert mine.returncode == 0 and json.loads(mine.stdout)["status"]["grants"] == ledger["grants"]
    assert can(cluster, sa, "watch", "grantledgers.continuum.dev/coder", ns) is True
    assert can(cluster, sa, "get", "grantledgers.continuum.dev/other", ns) is False
    for verb in ("update", "patch"):
        for target in ("coder", "other"):
            assert can(
                cluster, sa, verb, f"grantledgers.continuum.dev/{target}", ns,
                "--subresource=status",
            ) is False  # fmt: skip
    for verb in ("create", "delete", "update", "patch"):
        assert can(cluster, sa, verb, "grantledgers.continuum.dev/coder", ns) is False

    # Its ledger with one more grant, sent as the operator sends it (a replace of the status).
    forged = json.loads(mine.stdout)
    mallory = {"mind": f"{ns}/mallory", "state": "Granted", "tokens": 4096}
    forged["status"]["grants"].append(mallory)
    denied = kubectl_as(
        cluster, sa, "replace", "--subresource=status", "-f", "-", input=json.dumps(forged)
    )
    assert denied.returncode != 0, denied.stdout
    assert 'cannot update resource "grantledgers/status"' in denied.stderr, denied.stderr
    patched = kubectl_as(
        cluster, sa, "patch", "grantledger", "coder", "-n", ns, "--subresource=status",
        "--type=merge", "-p", json.dumps({"status": {"grants": forged["status"]["grants"]}}),
    )  # fmt: skip
    assert patched.returncode != 0 and "forbidden" in patched.stderr.lower(), patched.stderr
    gone = kubectl_as(cluster, sa, "delete", "grantledger", "coder", "-n", ns)
    assert gone.returncode != 0 and "forbidden" in gone.stderr.lower(), gone.stderr
    after = cluster.ledger_status(ns, "coder")
    assert after["grants"] == ledger["grants"] and after["grantStep"] == ledger["grantStep"]


def test_an_engine_service_account_changing_its_engines_plan_is_refused_naming_the_rule(
    cluster: Cluster,
    crds: None,
    tag: str,
    installed: Callable[[list[dict[str, Any]]], None],
) -> None:
    ns = scoped_namespace(cluster, tag)
    docs = policies(
        {"engineStatusPolicy": {"namespaceSelector": {"matchLabels": {SCOPE: tag}}}},
        "-engine-status",
    )
    installed(docs)
    status = type_checked(cluster, docs[0]["metadata"]["name"])
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status

    body = engine_body("coder", {"kind": "pvc", "claimName": "models", "path": "m.gguf"})
    cluster.apply(body, "-n", ns)
    made = cluster.get_json("engine", "coder", "-n", ns)
    engine = Engine.model_validate(made)
    cluster.apply(engine_identity.engine_rbac(engine, made["metadata"]["uid"]))
    other = engine_body("other")
    cluster.apply(other, "-n", ns)
    # What the operator wrote (the test's admin stands in for the operator).
    relaunches = {"count": 2, "lastReason": "the plan changed"}
    cluster.kubectl(
        "patch", "engine", "coder", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"relaunches": relaunches}}),
    )  # fmt: skip

    sa = f"system:serviceaccount:{ns}:{engine_objects.service_account_name(engine)}"
    # RBAC lets the engine patch its own Engine's status and nothing else: the fields within
    # status are the policy's to limit.
    assert can(cluster, sa, "patch", "engines.continuum.dev/coder", ns) is False
    assert kubectl_as(
        cluster, sa, "auth", "can-i", "patch", "engines.continuum.dev/coder",
        "--subresource=status", "-n", ns,
    ).stdout.strip() == "yes"  # fmt: skip
    assert kubectl_as(
        cluster, sa, "auth", "can-i", "patch", "engines.continuum.dev/other",
        "--subresource=status", "-n", ns,
    ).stdout.strip() == "no"  # fmt: skip

    def patch_status(
        patch: dict[str, Any], dry_run: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return kubectl_as(
            cluster, sa, "patch", "engine", "coder", "-n", ns, "--subresource=status",
            "--type=merge", "-p", json.dumps({"status": patch}),
            *(["--dry-run=server"] if dry_run else []),
        )  # fmt: skip

    # An engine claiming it is Ready (so that its minds are granted before it is).
    ready = {"conditions": [{"type": "Ready", "status": "True", "reason": "PodReady",
                             "message": "forged"}]}  # fmt: skip
    # Probed by a server-side dry run until the policy is active: a real patch let through
    # before that lands, and every later try is then a no-op the policy never sees (CI saw
    # "patched (no change)" for 180 s).
    refused_once_active(lambda: patch_status(ready, dry_run=True), "the forged condition refused")
    denied = patch_status(ready)
    assert denied.returncode != 0, denied.stdout
    for words in (
        "ValidatingAdmissionPolicy 'e2e-continuum-engine-status'",
        f"{sa} may change only status.runtime of its Engine, not status.conditions",
        "written by the continuum operator alone",
    ):
        assert words in denied.stderr, denied.stderr
    # What the operator wrote, rewritten or dropped: refused the same.
    for patch in ({"relaunches": {"count": 0}}, {"relaunches": None}):
        answer = patch_status(patch)
        assert answer.returncode != 0 and "not status.relaunches" in answer.stderr, answer.stderr
    # A field the schema does not name (the ledger's among them: it is a GrantLedger's now): the
    # status is typed, so the API server prunes it (never stored, checked below) and says so.
    answer = patch_status({"grants": [{"mind": f"{ns}/m", "state": "Granted"}],
                           "runtime": {"phase": "Serving"}})  # fmt: skip
    assert 'unknown field "status.grants"' in answer.stderr, answer.stderr
    # Its own report is what it may write.
    reported = patch_status({"runtime": {"phase": "Serving"}})
    assert reported.returncode == 0, reported.stderr
    after = cluster.get_json("engine", "coder", "-n", ns)["status"]
    assert after["relaunches"] == {**relaunches}
    assert after["runtime"] == {"phase": "Serving"} and "grants" not in after
    assert not [c for c in after.get("conditions") or [] if c.get("message") == "forged"]


# ============================================================================================
# Leader election and clock skew (docs/security.md "Leader election and clock skew")


def _leading(log: Path) -> bool:
    return log.exists() and "leading as" in log.read_text()


def test_two_operators_with_a_4_s_clock_skew_never_both_lead(
    cluster: Cluster, crds: None, tmp_path: Path
) -> None:
    # A Lease of 6 s renewed every 3 s, and a standby that looks every 0.7 s: it sees each
    # renewal over 2 s old, so one 4 s ahead that compared renewTime with its own clock took
    # the Lease in every renewal period, while the leader still counted it as held (both led).
    label = ("continuum.dev/e2e-boundaries", uuid.uuid4().hex[:8])
    timing = ("--leader-lease-duration", "6", "--leader-renew", "3")
    looking = ("--leader-lease-duration", "6", "--leader-renew", "0.7")
    first = start_operator(cluster, tmp_path, label, *timing, name="first")
    first_log = tmp_path / "first.log"
    second: subprocess.Popen[bytes] | None = None
    second_log = tmp_path / "second.log"
    try:
        wait_for("the first operator to lead", lambda: _leading(first_log), 90, first_log)
        second = start_operator(
            cluster, tmp_path, label, *looking,
            env={WALL_CLOCK_OFFSET_ENV: "4"}, name="second",
        )  # fmt: skip
        deadline = time.monotonic() + 25  # eight renewals
        while time.monotonic() < deadline:
            assert first.poll() is None, first_log.read_text()[-3000:]
            assert not _leading(second_log), "both led:\n" + second_log.read_text()[-3000:]
            time.sleep(0.25)
        assert "lost the leader Lease" not in first_log.read_text()
        first.send_signal(signal.SIGKILL)  # no hand-over: the standby waits out the Lease
        first.wait()
        killed = time.monotonic()
        wait_for("the skewed standby to take over", lambda: _leading(second_log), 60, second_log)
        assert time.monotonic() - killed >= 4.0  # not before the dead leader's Lease lapsed
    finally:
        stop(first)
        if second is not None:
            stop(second)


# ============================================================================================
# The node agent (docs/security.md "The node agent")


@dataclass(frozen=True)
class AgentRelease:
    namespace: str
    fullname: str
    service_account: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def as_agent_of(self, node: str | None) -> list[str]:
        """kubectl flags that make a request as this agent, its token naming `node` (None: a
        token bound to no pod, as `kubectl create token` makes)."""
        extra = [f"--as-user-extra={NODE_NAME_EXTRA}={node}"] if node else []
        return [f"--as={self.user}", *extra]


@pytest.fixture
def agent_release(cluster: Cluster, crds: None, namespace: str) -> Iterator[AgentRelease]:
    """The chart's agent: its ServiceAccount, RBAC and node-binding policy, released into
    this test's namespace."""
    release = f"b{uuid.uuid4().hex[:6]}"
    docs = documents(template(find_helm(), release=release, namespace=namespace).stdout)
    agent = [
        d for d in docs
        if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "agent"
        and d["kind"] != "DaemonSet"
    ]  # fmt: skip
    kinds = sorted(d["kind"] for d in agent)
    assert kinds == [
        "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    ], kinds  # fmt: skip
    cluster.apply(agent)
    sa = next(d for d in agent if d["kind"] == "ServiceAccount")["metadata"]["name"]
    fullname = f"{release}-continuum"
    try:
        yield AgentRelease(namespace, fullname, sa)
    finally:
        for d in agent:
            if not d["metadata"].get("namespace"):
                cluster.kubectl("delete", d["kind"], d["metadata"]["name"],
                                "--ignore-not-found", check=False)  # fmt: skip


def board(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "NodeBoard",
        "metadata": {"name": node},
        "spec": {},
    }


def lease(name: str, ns: str, node: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if node is not None:
        meta["annotations"] = {NODE_ANNOTATION: node}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": "agent", "leaseDurationSeconds": 40},
    }


def create_as(
    cluster: Cluster, body: dict[str, Any], who: list[str], dry_run: bool = False
) -> subprocess.CompletedProcess[str]:
    args = ["create", "-f", "-", *who, *(["--dry-run=server"] if dry_run else [])]
    return cluster.kubectl(*args, input=json.dumps(body), check=False)


def merge_patch_as(
    cluster: Cluster,
    release: AgentRelease,
    node: str,
    patch: Callable[[Any], Any],
) -> str:
    """A merge patch sent as the agent of `node` (kubectl patch reads the object first, which
    the agent may not do): `patch` calls the client's API on an impersonating ApiClient. The
    API server's refusal, or "" if it was let through."""
    from kubernetes import client, config  # the agent's own client library

    api = config.new_client_from_config(str(cluster.kubeconfig))
    api.set_default_header("Impersonate-User", release.user)
    api.set_default_header(f"Impersonate-Extra-{NODE_NAME_EXTRA.replace('/', '%2F')}", node)
    try:
        patch(api)
    except client.ApiException as err:
        return str(json.loads(err.body or "{}").get("message", err.body))
    finally:
        api.close()
    return ""


MERGE = "application/merge-patch+json"


def can_i(cluster: Cluster, who: list[str], *args: str) -> bool:
    out = cluster.kubectl("auth", "can-i", *args, *who, check=False).stdout.strip()
    return out == "yes"


def test_an_agent_cannot_write_a_kubelets_lease_in_kube_node_lease(
    cluster: Cluster, agent_release: AgentRelease, gpu_node: str
) -> None:
    agent = agent_release.as_agent_of(gpu_node)
    assert not can_i(cluster, agent, "create", "leases", "-n", "kube-node-lease")
    assert not can_i(cluster, agent, "patch", "leases", "-n", "kube-node-lease")
    assert can_i(cluster, agent, "patch", "leases", "-n", agent_release.namespace)  # its own
    # No pod list either: its board's spec names its node's engine and lane pods.
    assert not can_i(cluster, agent, "list", "pods", "--all-namespaces")
    assert not can_i(cluster, agent, "get", "pods", "-n", "kube-system")
    assert can_i(cluster, agent, "get", f"nodeboards.continuum.dev/{gpu_node}")
    # The kubelet's own heartbeat of the agent's very node: RBAC refuses, naming the namespace.
    kubelets = wait_for(
        f"the kubelet's Lease of {gpu_node}",
        lambda: cluster.kubectl("get", "lease", gpu_node, "-n", "kube-node-lease",
                                check=False).returncode == 0,
        timeout=60,
    )  # fmt: skip
    assert kubelets
    from kubernetes import client

    patch = merge_patch_as(
        cluster, agent_release, gpu_node,
        lambda api: client.CoordinationV1Api(api).patch_namespaced_lease(
            gpu_node, "kube-node-lease", {"spec": {"holderIdentity": "forged"}},
            _content_type=MERGE,
        ),
    )  # fmt: skip
    assert 'cannot patch resource "leases"' in patch
    assert 'in the namespace "kube-node-lease"' in patch
    made = create_as(cluster, lease(lease_name(gpu_node), "kube-node-lease", gpu_node), agent)
    assert 'cannot create resource "leases"' in refused(made)


def test_an_agent_writes_only_its_own_nodes_board_and_lease(
    cluster: Cluster, agent_release: AgentRelease
) -> None:
    ns, policy = agent_release.namespace, f"{agent_release.fullname}-agent-node-binding"
    mine, other = f"bnd-a-{uuid.uuid4().hex[:6]}", f"bnd-b-{uuid.uuid4().hex[:6]}"
    agent = agent_release.as_agent_of(mine)
    # RBAC alone lets every agent write every board: the policy is what binds it to its node.
    assert can_i(cluster, agent, "create", "nodeboards.continuum.dev")
    try:
        answer = wait_for(
            "the node-binding policy to refuse another node's board",
            lambda: (
                (p := create_as(cluster, board(other), agent, dry_run=True)).returncode != 0 and p
            ),
            timeout=60,
        )
        assert f"may write only NodeBoard {mine}, not {other}" in answer.stderr
        assert policy in answer.stderr
        # Its own board, claiming pods: which pods are where is the operator's to say.
        pod = {"uid": "u", "kind": "Engine", "namespace": "x", "name": "y"}
        claiming = {**board(mine), "spec": {"placed": [pod]}}
        assert "with no spec.placed" in refused(create_as(cluster, claiming, agent, dry_run=True))
        assert create_as(cluster, board(mine), agent).returncode == 0
        # Another node's existing board: its status cannot be patched either.
        cluster.apply(board(other))
        from kubernetes import client

        status = merge_patch_as(
            cluster, agent_release, mine,
            lambda api: client.CustomObjectsApi(api).patch_cluster_custom_object_status(
                "continuum.dev", "v1alpha1", "nodeboards", other,
                {"status": {"memoryMode": "unknown"}}, _content_type=MERGE,
            ),
        )  # fmt: skip
        assert f"may write only NodeBoard {mine}, not {other}" in status
        # Leases of its namespace: its own node's only, never another's or the leader's.
        theirs = create_as(cluster, lease(lease_name(other), ns, other), agent)
        assert f"may write only Lease {lease_name(mine)}" in refused(theirs)
        forged = create_as(cluster, lease(lease_name(other), ns, mine), agent)  # annotated mine
        assert f"may write only Lease {lease_name(mine)}" in refused(forged)
        leader = create_as(cluster, lease(f"{agent_release.fullname}-leader", ns), agent)
        assert policy in refused(leader)
        own = create_as(cluster, lease(lease_name(mine), ns, mine), agent)
        assert own.returncode == 0, own.stderr
        # A token that names no node (one made by hand, not bound to the agent's pod).
        unbound = create_as(cluster, board(mine), agent_release.as_agent_of(None), dry_run=True)
        assert "names none" in refused(unbound)
    finally:
        for node in (mine, other):
            cluster.kubectl("delete", "nodeboard", node, "--ignore-not-found", check=False)


def test_an_agent_of_a_long_node_name_cannot_take_another_long_named_nodes_lease(
    cluster: Cluster, agent_release: AgentRelease
) -> None:
    """A node name too long for the Lease's prefix gives a Lease name shortened with a hash the
    policy cannot compute, so it checks the prefix and the annotation. Found by review: on an
    update it read only the new annotation, so the agent of one such node could re-annotate
    another's Lease as its own, whose board then vouched for no node."""
    ns = agent_release.namespace
    tail = uuid.uuid4().hex[:6]
    long = ".".join(["n" * 60] * 4)  # 243 characters with the tail: past the prefix's room
    mine, other = f"{long}.a{tail}", f"{long}.b{tail}"
    assert len(lease_name(mine)) == len(lease_name(other)) == 253
    cluster.apply(lease(lease_name(other), ns, other))  # the other node's agent made it
    agent = agent_release.as_agent_of(mine)
    wait_for(
        "the node-binding policy in force",
        lambda: create_as(cluster, board(other), agent, dry_run=True).returncode != 0,
        timeout=180,
    )
    from kubernetes import client

    def annotate(name: str) -> str:
        return merge_patch_as(
            cluster, agent_release, mine,
            lambda api: client.CoordinationV1Api(api).patch_namespaced_lease(
                name, ns, {"metadata": {"annotations": {NODE_ANNOTATION: mine}}},
                _content_type=MERGE,
            ),
        )  # fmt: skip

    taken = annotate(lease_name(other))
    assert "may write only Lease continuum-agent-" in taken, taken
    assert f"{agent_release.fullname}-agent-node-binding" in taken, taken
    kept = cluster.get_json("lease", lease_name(other), "-n", ns)["metadata"]["annotations"]
    assert kept[NODE_ANNOTATION] == other
    # Its own long-named Lease it creates and renews as before.
    own = create_as(cluster, lease(lease_name(mine), ns, mine), agent)
    assert own.returncode == 0, own.stderr
    assert annotate(lease_name(mine)) == ""


def _pod_bound_kubeconfig(cluster: Cluster, release: AgentRelease, pod: str, path: Path) -> Path:
    """A kubeconfig with the agent's token bound to `pod`, as the kubelet mounts it."""
    token = cluster.kubectl(
        "create", "token", release.service_account, "-n", release.namespace,
        "--bound-object-kind=Pod", f"--bound-object-name={pod}", "--duration=10m",
    ).stdout.strip()  # fmt: skip
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == admin["current-context"])
    server = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path.write_text(
        yaml_text.dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [server],
                "users": [{"name": "agent", "user": {"token": token}}],
                "contexts": [{"name": "agent", "context": {"cluster": server["name"],
                                                           "user": "agent"}}],
                "current-context": "agent",
            }
        )
    )  # fmt: skip
    return path


def test_the_agent_with_its_pods_token_writes_its_nodes_board_and_is_refused_another(
    cluster: Cluster, agent_release: AgentRelease, gpu_node: str, tmp_path: Path
) -> None:
    """`continuum agent` as the DaemonSet's pod runs it: its token bound to its pod, on its node,
    which the API server reads from the token (no impersonation)."""
    ns = agent_release.namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent", "namespace": ns},
        "spec": {
            "nodeName": gpu_node,
            "serviceAccountName": agent_release.service_account,
            "containers": [{"name": "agent", "image": "continuum-agent:e2e"}],
        },
    }
    cluster.apply(pod)
    kubeconfig = _pod_bound_kubeconfig(cluster, agent_release, "agent", tmp_path / "agent.kcfg")
    other = f"bnd-other-{uuid.uuid4().hex[:6]}"

    def agent(node: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "continuum_operator.cli", "agent", "--once",
             "--node-name", node, "--lease-namespace", ns, "--kubeconfig", str(kubeconfig)],
            capture_output=True, text=True, timeout=180, check=False,
            env={**cluster.env, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip

    try:
        wait_for(
            "the node-binding policy to be active",
            lambda: create_as(cluster, board(other), agent_release.as_agent_of(gpu_node),
                              dry_run=True).returncode != 0,
            timeout=60,
        )  # fmt: skip
        ran = agent(gpu_node)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert cluster.get_json("nodeboard", gpu_node)["status"]["pools"]
        written = cluster.get_json("lease", lease_name(gpu_node), "-n", ns)
        meta = written["metadata"]
        assert node_of_lease(meta["name"], meta.get("annotations")) == gpu_node
        lied = agent(other)  # the same pod's token, claiming another node
        assert lied.returncode != 0
        assert f"may write only NodeBoard {gpu_node}, not {other}" in lied.stdout + lied.stderr
    finally:
        cluster.kubectl("delete", "nodeboard", gpu_node, other, "--ignore-not-found",
                        check=False)  # fmt: skip


# ============================================================================================
# Children of minds (docs/security.md "Children of minds")


def test_a_pod_her_service_account_creates_without_the_label_is_still_her_child(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    ns, pods = namespace, PodSettings()
    mind = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": "ada", "namespace": ns},
        "spec": {"engine": "coder", "contextTokens": 4096},
    }
    may_create_pods = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": n, "namespace": ns}}
        for n in ("ada", "web")
    ] + [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pods", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "pods", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
            "subjects": [{"kind": "ServiceAccount", "name": n, "namespace": ns}
                         for n in ("ada", "web")],
        },
    ]  # fmt: skip
    cluster.apply([mind, *may_create_pods])
    as_ada = [f"--as=system:serviceaccount:{ns}:ada"]
    as_web = [f"--as=system:serviceaccount:{ns}:web"]
    try:
        with webhook_operator(cluster, tmp_path, free_port()) as op:
            # Ready means her pods are known as hers: the Service sends the API server's reviews
            # to ready replicas only, and a replica that answered before listing the Minds let
            # her pods through as ordinary ones. So the first pod after it is hers, no retry.
            before = wait_ready(op)
            assert before and set(before) == {503}, before  # not ready from the start
            made = cluster.kubectl("create", "-f", "-", "-o", "json", *as_ada,
                                   input=json.dumps(child_pod("build", ns)))  # fmt: skip
            child = json.loads(made.stdout)
            assert child["metadata"]["labels"] == {MIND_LABEL: "ada"}  # labelled: counted too
            assert child["metadata"]["annotations"][CLASS_ANNOTATION] == BACKGROUND
            assert child["spec"]["priorityClassName"] == pods.children_priority_class
            assert "cpu" not in child["spec"]["containers"][0]["resources"]["limits"]
            # Another service account of her namespace (no Mind of its name): an ordinary pod.
            other = json.loads(
                cluster.kubectl(
                    "create",
                    "-f",
                    "-",
                    "-o",
                    "json",
                    *as_web,
                    input=json.dumps(child_pod("web", ns)),
                ).stdout
            )
            assert MIND_LABEL not in (other["metadata"].get("labels") or {})
            assert other["spec"].get("priorityClassName") != pods.children_priority_class
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", WEBHOOK, "--ignore-not-found",
                        check=False)  # fmt: skip


# ============================================================================================
# Crash recovery in a Helm install (docs/security.md, docs/crash-points.md "In a Helm install")


def chart_operator_args(release: str, label: tuple[str, str], metrics_port: int) -> list[str]:
    """`continuum operator`'s arguments as the chart renders them, for this test's Engines (its
    engine selector), a release of its own (the leader Lease's name) and short timings (chart
    values too). Installed in `default`, where the tests' node agents keep their Leases."""
    values = {
        "webhook": {"enabled": False},  # its certificates are cert-manager's, in-cluster
        "metrics": {"port": metrics_port},
        "operator": {
            "engineSelector": dict([label]),
            "resyncSeconds": 1,
            "graceSeconds": 3,
            "leaderElection": {"leaseDurationSeconds": 6, "renewSeconds": 1},
        },
    }
    docs = documents(template(find_helm(), values, release=release, namespace="default").stdout)
    deployment = one(docs, "Deployment", "-operator")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_a_helm_installs_operator_killed_mid_step_and_restarted_loses_or_doubles_no_grant(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    tag = f"h{uuid.uuid4().hex[:8]}"
    label = ("continuum.dev/e2e-grants", tag)
    args = chart_operator_args(tag, label, free_port())
    assert args[0] == "operator"
    assert not [a for a in args if a.startswith("--transition-log")]  # what the claim rests on
    names = {"low": f"low-{tag}", "high": f"high-{tag}"}
    cluster.apply([mind_class(names["low"], 0), mind_class(names["high"], 10)])

    def start(name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "continuum_operator.cli", *args,
               "--kubeconfig", str(cluster.kubeconfig)]  # fmt: skip
        with (tmp_path / f"{name}.log").open("ab") as out:
            return subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**cluster.env, **(env or {})}
            )

    try:
        grants_gpu_node(cluster, tag)
        cluster.apply(grants_engine("coder", tag, label, minds=2), "-n", namespace)
        zero = start("zero")
        try:
            wait_for("the engine serving", serving(cluster, namespace, 2), timeout=90)
        finally:
            stop(zero)
        first = start("first", {"CONTINUUM_CRASH_AT": "after-ledger-write@2"})
        try:
            scenario(cluster, namespace, names, lambda: first.poll() is not None)
            assert wait_for("the crash", first.poll, timeout=60, log=tmp_path / "first.log") == 137
            assert "crash point after-ledger-write reached" in (tmp_path / "first.log").read_text()
        finally:
            stop(first)
        second = start("second")
        try:
            wait_for("the ledger settled", settled(cluster, namespace), timeout=90,
                     log=tmp_path / "second.log")  # fmt: skip
            assert_no_grant_doubled(cluster, namespace)
        finally:
            stop(second)
        assert not list(tmp_path.glob("*.jsonl"))  # and no log was kept anywhere
    finally:
        cluster.kubectl("delete", "mindclass", *names.values(), "--wait=false", check=False)
