"""The Helm chart (charts/continuum): `helm lint` and `helm template` with default and non-default
values, the schema refusing bad values with a message, CRD templates that match crds/, flags the
operator and the agent really accept, and RBAC that covers what the operator grants its pods.

Needs helm from `tools/cluster build`; fails (never skips) without it.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.cli import build_parser
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.grants import mind_writes
from continuum_operator.kube.workloads import engine_identity, engine_objects, lane_objects
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from tests.support import builders
from tests.support.builders import ROOT, tree
from tests.support.helm import CHART, by_kind, documents, find_helm, helm, one, template

Rule = Mapping[str, Any]

NON_DEFAULT: dict[str, Any] = {
    "fullnameOverride": "ctm",
    "images": {
        "operator": {"repository": "registry.local/op", "tag": "t1"},
        "agent": {"repository": "registry.local/agent", "tag": "t2"},
        "engine": {"repository": "registry.local/engine", "tag": "t3"},
    },
    "imagePullSecrets": ["pull"],
    "crds": {"install": True, "keep": False},
    "operator": {
        "replicas": 3,
        "engineSelector": {"team": "a"},
        "gpuSharing": "auto",
        "gpuClaims": "dra",
        "laneCpu": "1500m",
        "damping": {"readings": 5, "minGain": 0.2, "cooldownSeconds": 600},
        "extraArgs": ["--board-ttl=60"],
        "priorityClassName": "system-cluster-critical",
    },
    "agent": {
        "runtimeClassName": "nvidia",
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "intervalSeconds": 5,
        "leaseSeconds": 20,
        "kubepodsCgroup": "kubepods",
    },
    "priorityClasses": {"childrenName": "mind-kids"},
    "webhook": {"enabled": True, "timeoutSeconds": 3},
    "metrics": {
        "port": 9100,
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True},
    },
    "dashboards": {"enabled": True},
}


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    return find_helm()


@pytest.fixture(scope="module")
def default_docs(helm_bin: Path) -> list[dict[str, Any]]:
    return documents(template(helm_bin).stdout)


@pytest.fixture(scope="module")
def custom_docs(helm_bin: Path) -> list[dict[str, Any]]:
    return documents(template(helm_bin, NON_DEFAULT).stdout)


def _container(doc: Mapping[str, Any]) -> dict[str, Any]:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def _parse(args: Sequence[str]) -> Any:
    """The container's arguments through `continuum`'s own parser (exits 2 on a bad flag)."""
    return build_parser().parse_args(list(args))


def allows(rules: Sequence[Rule], group: str, resource: str, verb: str, name: str = "") -> bool:
    for rule in rules:
        if group not in rule.get("apiGroups", []) and "*" not in rule.get("apiGroups", []):
            continue
        if resource not in rule.get("resources", []) and "*" not in rule.get("resources", []):
            continue
        if verb not in rule.get("verbs", []) and "*" not in rule.get("verbs", []):
            continue
        names = rule.get("resourceNames")
        if names and name not in names:
            continue
        return True
    return False


def _expand(rules: Sequence[Rule]) -> Iterator[tuple[str, str, str, str]]:
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    for name in rule.get("resourceNames") or [""]:
                        yield group, resource, verb, name


# --- lint and render ---------------------------------------------------------------------------


def test_helm_lint_passes_with_default_and_non_default_values(
    helm_bin: Path, tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(NON_DEFAULT))
    for extra in ([], ["-f", str(values)]):
        proc = helm(helm_bin, "lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in proc.stdout


def test_the_default_install_has_operator_agent_rbac_crds_classes_and_metrics(
    default_docs: list[dict[str, Any]],
) -> None:
    kinds = sorted({d["kind"] for d in default_docs})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "DaemonSet",
        "Deployment",
        "Job",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    # Optional parts are off by default: no Prometheus-operator objects, no dashboard. The
    # children's webhook is on (its certificate is the one Secret).
    assert not by_kind(default_docs, "ServiceMonitor")
    assert [d["metadata"]["name"] for d in by_kind(default_docs, "Secret")] == [
        "r1-continuum-webhook-tls"
    ]
    deployment = one(default_docs, "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 2
    assert one(default_docs, "Service", "-operator-metrics")["spec"]["ports"][0]["port"] == 8000


def test_every_object_is_namespaced_in_the_release_or_cluster_scoped(
    default_docs: list[dict[str, Any]],
) -> None:
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for doc in default_docs:
        ns = doc["metadata"].get("namespace")
        if doc["kind"] in cluster_scoped:
            assert ns is None, doc["metadata"]["name"]
        else:  # the agents' node Leases too: never kube-node-lease, the kubelets' namespace
            assert ns == "continuum-system", f"{doc['kind']} {doc['metadata']['name']}"


# --- CRDs ---------------------------------------------------------------------------------------


def test_the_charts_crd_files_are_the_generated_crds_unchanged() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    shipped = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert shipped == generated, "run: cp crds/*.yaml charts/continuum/files/crds/"
    for name in generated:
        assert (CHART / "files" / "crds" / name).read_text() == (
            ROOT / "crds" / name
        ).read_text(), (
            f"charts/continuum/files/crds/{name} drifted from crds/{name}: "
            "run `cp crds/*.yaml charts/continuum/files/crds/`"
        )


def test_crds_render_as_templates_kept_on_uninstall_with_their_schemas_intact(
    default_docs: list[dict[str, Any]],
) -> None:
    rendered = {d["metadata"]["name"]: d for d in by_kind(default_docs, "CustomResourceDefinition")}
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        source = yaml.safe_load(path.read_text())
        crd = rendered[source["metadata"]["name"]]
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "continuum"
        assert crd["spec"] == source["spec"]  # the whole schema, unchanged by the templating


def test_crds_can_be_left_out_or_not_kept(helm_bin: Path) -> None:
    without = documents(template(helm_bin, {"crds": {"install": False}}).stdout)
    assert not by_kind(without, "CustomResourceDefinition")
    unkept = documents(template(helm_bin, {"crds": {"keep": False}}).stdout)
    for crd in by_kind(unkept, "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


# --- the operator and the agent: flags their commands accept ----------------------------------


def test_the_operators_arguments_are_flags_continuum_operator_accepts(
    default_docs: list[dict[str, Any]], custom_docs: list[dict[str, Any]]
) -> None:
    default = _parse(_container(one(default_docs, "Deployment", "-operator"))["args"])
    assert default.command == "operator"
    assert default.leader_election is True
    assert default.leader_namespace == "continuum-system"
    assert default.leader_lease == "r1-continuum-leader"
    assert default.metrics_port == 8000
    assert default.webhook is True  # the children's webhook is on by default
    assert default.engine_image == "ghcr.io/continuum-dev/continuum-engine:0.1.0"
    assert default.gpu_claims == "device-plugin"

    custom = _parse(_container(one(custom_docs, "Deployment", "-operator"))["args"])
    assert custom.engine_selector == "team=a"
    assert custom.gpu_sharing == "auto"
    assert custom.gpu_claims == "dra"
    assert custom.lane_cpu == "1500m"
    assert (custom.damping_readings, custom.damping_min_gain) == (5, 0.2)
    assert custom.relaunch_cooldown == 600
    assert custom.board_ttl == 60  # extraArgs reach the command
    assert custom.engine_image == "registry.local/engine:t3"
    assert custom.children_priority_class == "mind-kids"
    assert custom.webhook is True
    assert custom.webhook_host == "ctm-webhook.continuum-system.svc"
    assert custom.webhook_timeout == 3
    assert custom.webhook_certfile == "/etc/continuum/webhook/tls.crt"
    assert custom.metrics_port == 9100


def test_the_webhook_configuration_names_the_charts_service_unless_a_url_is_asked_for(
    helm_bin: Path, custom_docs: list[dict[str, Any]]
) -> None:
    """Managed API servers may not resolve cluster DNS: by default the operator installs a
    clientConfig.service reference to the Service the chart made (its namespace, name, port)."""
    from continuum_operator.cli.operator import settings_from
    from continuum_operator.kube.children import webhook

    args = _parse(_container(one(custom_docs, "Deployment", "-operator"))["args"])
    children = settings_from(args).children
    service = one(custom_docs, "Service", "-webhook")
    client = tree(webhook.webhook_configuration({"url": "https://ignored"}, children))["webhooks"][
        0
    ]["clientConfig"]
    assert client["service"] == {
        "namespace": service["metadata"]["namespace"],
        "name": service["metadata"]["name"],
        "port": service["spec"]["ports"][0]["port"],
        "path": f"/{webhook.HANDLER_ID}",
    }
    assert "url" not in client

    values = {**NON_DEFAULT, "webhook": {**NON_DEFAULT["webhook"], "clientConfig": "url"}}
    docs = documents(template(helm_bin, values).stdout)
    url_args = _parse(_container(one(docs, "Deployment", "-operator"))["args"])
    assert url_args.webhook_service is None
    assert settings_from(url_args).children.host == "ctm-webhook.continuum-system.svc"


def test_the_agents_arguments_are_flags_continuum_agent_accepts(
    default_docs: list[dict[str, Any]], custom_docs: list[dict[str, Any]]
) -> None:
    ds = one(default_docs, "DaemonSet", "-agent")
    args = _parse(_container(ds)["args"])
    assert args.command == "agent"
    assert args.in_cluster is True
    assert str(args.cgroup_dir) == "/host/sys/fs/cgroup/kubepods.slice"
    assert args.lease_seconds > args.interval
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert "runtimeClassName" not in pod
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    env = {e["name"]: e for e in _container(ds)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Its metrics on the port the container names (the PodMonitor scrapes it by that name).
    assert args.metrics_port == 9102
    assert _container(ds)["ports"] == [{"name": "metrics", "containerPort": 9102}]

    custom = one(custom_docs, "DaemonSet", "-agent")
    cpod = custom["spec"]["template"]["spec"]
    assert cpod["runtimeClassName"] == "nvidia"
    assert cpod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    cargs = _parse(_container(custom)["args"])
    assert (cargs.interval, cargs.lease_seconds) == (5, 20)
    assert str(cargs.cgroup_dir) == "/host/sys/fs/cgroup/kubepods"
    assert _container(custom)["image"] == "registry.local/agent:t2"


def test_both_pods_run_non_root_on_a_read_only_root_with_no_capabilities(
    default_docs: list[dict[str, Any]],
) -> None:
    for doc in (one(default_docs, "Deployment"), one(default_docs, "DaemonSet")):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = _container(doc)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in _container(doc)["volumeMounts"]}
        assert "/tmp" in mounts  # the only writable place
        assert "limits" in _container(doc)["resources"]


def test_replicas_spread_over_nodes_and_roll_one_at_a_time(
    default_docs: list[dict[str, Any]],
) -> None:
    deployment = one(default_docs, "Deployment", "-operator")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"


def test_one_replica_without_leader_election_runs_with_no_leader_election(
    helm_bin: Path,
) -> None:
    values = {"operator": {"replicas": 1, "leaderElection": {"enabled": False}}}
    docs = documents(template(helm_bin, values).stdout)
    args = _parse(_container(one(docs, "Deployment", "-operator"))["args"])
    assert args.leader_election is False
    assert not [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader")]


# --- priority classes ---------------------------------------------------------------------------


def test_priority_classes_are_left_to_the_operator_which_may_apply_them(
    custom_docs: list[dict[str, Any]],
) -> None:
    """The operator applies them at every start (server-side, forced); the chart owning them too
    made `helm upgrade` conflict on the real API server, so it names the children's class only."""
    assert not by_kind(custom_docs, "PriorityClass")
    rules = one(custom_docs, "ClusterRole", "-operator")["rules"]
    for verb in ("create", "patch"):
        assert allows(rules, "scheduling.k8s.io", "priorityclasses", verb)
    args = _parse(_container(one(custom_docs, "Deployment", "-operator"))["args"])
    assert args.children_priority_class == "mind-kids"


# --- webhook ------------------------------------------------------------------------------------


def test_the_webhook_gets_a_service_and_a_certificate_for_its_service_name(
    custom_docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    service = one(custom_docs, "Service", "-webhook")
    assert service["spec"]["ports"][0]["port"] == 9443
    secret = one(custom_docs, "Secret", "-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    files = {}
    for key in ("ca.crt", "tls.crt", "tls.key"):
        files[key] = tmp_path / key
        files[key].write_bytes(base64.b64decode(secret["data"][key]))
    # The serving certificate is signed by the CA and names the Service's DNS name.
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(files["ca.crt"]), str(files["tls.crt"])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-in", str(files["tls.crt"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:ctm-webhook.continuum-system.svc" in text
    deployment = one(custom_docs, "Deployment", "-operator")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == "ctm-webhook-tls"


def test_the_webhook_replicas_are_gated_by_readiness_whatever_metrics_says(
    helm_bin: Path,
) -> None:
    """/readyz (ready once the webhook serves knowing every Mind) is served only beside /metrics
    on --metrics-port: with metrics.enabled=false a replica without it (and without a probe)
    would join the webhook Service before its Mind cache is filled."""
    docs = documents(
        template(
            helm_bin,
            {"metrics": {"enabled": False, "port": 9200, "serviceMonitor": {"enabled": True}}},
        ).stdout
    )
    assert one(docs, "Service", "-webhook")
    container = _container(one(docs, "Deployment", "-operator"))
    args = _parse(container["args"])
    assert args.webhook and args.metrics_port == 9200
    assert {"name": "metrics", "containerPort": 9200} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    # What metrics.enabled still gates: the metrics Service, and the monitors that scrape it.
    assert not [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics")]
    assert not by_kind(docs, "ServiceMonitor") and not by_kind(docs, "PodMonitor")


def test_the_operator_may_patch_only_its_own_webhook_configuration(
    custom_docs: list[dict[str, Any]], helm_bin: Path
) -> None:
    rules = one(custom_docs, "ClusterRole", "-operator")["rules"]
    group, kind = "admissionregistration.k8s.io", "mutatingwebhookconfigurations"
    assert allows(rules, group, kind, "patch", "continuum-mind-children")
    assert not allows(rules, group, kind, "patch", "someone-elses")
    assert not allows(rules, group, kind, "delete", "continuum-mind-children")
    without = documents(template(helm_bin, {"webhook": {"enabled": False}}).stdout)
    assert not allows(one(without, "ClusterRole", "-operator")["rules"], group, kind, "create")


def test_cert_manager_mode_asks_cert_manager_for_the_certificate(helm_bin: Path) -> None:
    values = {"webhook": {"enabled": True, "certificates": {"mode": "certManager"}}}
    docs = documents(template(helm_bin, values).stdout)
    cert = one(docs, "Certificate")
    assert cert["spec"]["dnsNames"][0] == "r1-continuum-webhook.continuum-system.svc"
    assert cert["spec"]["issuerRef"]["name"] == one(docs, "Issuer")["metadata"]["name"]
    assert not by_kind(docs, "Secret")


# --- RBAC ---------------------------------------------------------------------------------------


def test_the_operator_holds_every_right_it_grants_engine_and_lane_pods(
    default_docs: list[dict[str, Any]],
) -> None:
    """RBAC lets nobody grant a right it lacks: the Roles it makes for its pods are subsets."""
    rules = one(default_docs, "ClusterRole", "-operator")["rules"]
    engine = builders.engine(builders.engine_body())
    lane_path = ROOT / "examples" / "embedlanes" / "notes.yaml"
    lane = EmbedLane.model_validate(yaml.safe_load(lane_path.read_text()))
    granted = [
        *engine_identity.engine_rbac(engine, "uid-1"),
        *lane_objects.lane_identity(lane, "uid-2"),
    ]
    roles = [o for o in granted if o["kind"] == "Role"]
    assert len(roles) == 2
    for role in roles:
        for group, resource, verb, name in _expand(role["rules"]):
            assert allows(rules, group, resource, verb, name), (group, resource, verb, name)
    # ... and it may create the objects of that identity (server-side apply: create + patch).
    for obj in granted:
        plural = {
            "ServiceAccount": "serviceaccounts",
            "Role": "roles",
            "RoleBinding": "rolebindings",
            "ClusterRoleBinding": "clusterrolebindings",
        }
        group = obj["apiVersion"].rpartition("/")[0]
        for verb in ("create", "patch"):
            assert allows(rules, group, plural[obj["kind"]], verb), (obj["kind"], verb)
        if obj["kind"] == "ClusterRoleBinding":  # the gateway's TokenReview: bound, not held
            role = obj["roleRef"]["name"]
            assert allows(rules, group, "clusterroles", "bind", role), role
            assert not allows(rules, group, "clusterroles", "bind", "cluster-admin")


def _made_for_an_engine_and_a_lane() -> list[dict[str, Any]]:
    """Every namespaced object the operator makes for an Engine and for an EmbedLane."""
    from continuum_operator.kube.base.settings import GpuClaims
    from continuum_operator.kube.workloads import facts_job

    engine, p = builders.engine_planned_on_a_gpu()
    pods = PodSettings()
    claim = engine_objects.gpu_claim_template(
        engine, "uid-1", builders.plan_on_a_gpu(gpus=(0,)), PodSettings(gpu_claims=GpuClaims.DRA)
    )
    assert claim is not None
    lane = EmbedLane.model_validate(
        yaml.safe_load((ROOT / "examples" / "embedlanes" / "notes.yaml").read_text())
    )
    placement = EmbedLanePlacement.model_validate(
        {"node": "n", "verdict": "Fits", "residence": "host", "pools": []}
    )
    return [
        engine_objects.deployment(engine, "uid-1", p, pods, node_has_gpus=True),
        engine_objects.service(engine, "uid-1", pods),
        claim,
        facts_job.facts_job(engine, "uid-1", pods),
        engine_identity.network_policy(engine, "uid-1", pods),
        *engine_identity.engine_rbac(engine, "uid-1"),
        lane_objects.lane_deployment(lane, "uid-2", placement, engine, pods),
        *lane_objects.lane_identity(lane, "uid-2"),
        lane_objects.lane_network_policy(lane, "uid-2", pods),
    ]


def test_the_operator_may_set_block_owner_deletion_on_everything_it_owns(
    default_docs: list[dict[str, Any]],
) -> None:
    """Under the OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened
    clusters) an ownerReference with blockOwnerDeletion needs `update` on the owner's
    `finalizers`: without it every create and apply of an owned object is refused."""
    rules = one(default_docs, "ClusterRole", "-operator")["rules"]
    plural = {"Engine": "engines", "EmbedLane": "embedlanes"}
    blocking = {
        (obj["kind"], ref["kind"])
        for obj in _made_for_an_engine_and_a_lane()
        for ref in obj["metadata"].get("ownerReferences") or []
        if ref.get("blockOwnerDeletion")
    }
    assert {owner for _, owner in blocking} == set(plural)
    # Any other kind the operator names as a controller owner would need its rule too.
    named = set(
        re.findall(
            r'controller_reference\(\s*"(\w+)"',
            "".join(p.read_text() for p in (ROOT / "operator").rglob("*.py")),
        )
    )
    assert named <= set(plural), named
    missing = sorted(
        f"{plural[owner]}/finalizers (for {kind})"
        for kind, owner in blocking
        if not allows(rules, "continuum.dev", f"{plural[owner]}/finalizers", "update")
    )
    assert not missing, missing
    # Exactly that: it writes no finalizer on Engines or EmbedLanes.
    for resource in plural.values():
        for verb in ("patch", "create", "delete"):
            assert not allows(rules, "continuum.dev", f"{resource}/finalizers", verb)


def test_the_docs_print_the_operators_rules_from_the_chart_instead_of_a_list_of_their_own(
    helm_bin: Path, tmp_path: Path
) -> None:
    """With operator.rbac.create=false the admin grants the rules by hand: the docs send them to
    the rendered rules (a hand-written list missed NetworkPolicies, the TokenReview bindings,
    EmbedLanes...), and the command they give renders the chart's own."""
    operator_md = (ROOT / "docs" / "operator.md").read_text()
    for name in ("operator.md", "grants.md"):
        text = (ROOT / "docs" / name).read_text()
        listed = re.findall(r"\b(?:get|list|watch|create|patch|update)/[a-z/]+ on\b", text)
        assert not listed, f"docs/{name} lists the operator's RBAC by hand again: {listed}"
    command = re.search(
        r"helm template (.*\\\n.*--show-only templates/rbac-operator\.yaml)", operator_md
    )
    assert command is not None, "docs/operator.md no longer prints the operator's rules"
    values = tmp_path / "my-values.yaml"
    values.write_text(yaml.safe_dump({"operator": {"rbac": {"create": False}}}))
    where = {"charts/continuum": str(CHART), "my-values.yaml": str(values)}
    args = [where.get(a, a) for a in command.group(1).replace("\\\n", " ").split()]
    printed = documents(helm(helm_bin, "template", *args).stdout)
    kinds = sorted(d["kind"] for d in printed)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"], kinds
    chart = documents(template(helm_bin, release=args[0]).stdout)
    for kind, suffix in (("ClusterRole", "-operator"), ("Role", "-operator-leader")):
        assert one(printed, kind, suffix)["rules"] == one(chart, kind, suffix)["rules"]


def test_the_operator_may_write_the_gpu_claim_templates_it_makes_with_dra_and_nothing_more(
    default_docs: list[dict[str, Any]],
) -> None:
    from continuum_operator.kube.base.settings import GpuClaims, PodSettings

    rules = one(default_docs, "ClusterRole", "-operator")["rules"]
    engine = builders.engine(builders.engine_body())
    claim = engine_objects.gpu_claim_template(
        engine, "uid-1", builders.plan_on_a_gpu(gpus=(1,)), PodSettings(gpu_claims=GpuClaims.DRA)
    )
    assert claim is not None
    group = claim["apiVersion"].rpartition("/")[0]
    assert group == "resource.k8s.io"
    for verb in ("create", "patch"):  # server-side apply
        assert allows(rules, group, "resourceclaimtemplates", verb)
    for verb in ("delete", "get", "list"):  # owned by the Engine: deleted with it
        assert not allows(rules, group, "resourceclaimtemplates", verb)
    assert not allows(rules, group, "resourceclaims", "create")  # the pods' are Kubernetes'


def test_the_operator_has_no_wildcards_no_secrets_and_no_deletes_beyond_its_workloads(
    default_docs: list[dict[str, Any]],
) -> None:
    rules = one(default_docs, "ClusterRole", "-operator")["rules"]
    for group, resource, verb, _ in _expand(rules):
        assert "*" not in (group, resource, verb)
        assert resource != "secrets"
        if verb == "delete":
            assert resource in {"deployments", "services", "jobs", "grantledgers"}, resource
        if group == "continuum.dev" and resource.endswith("/finalizers"):
            # Only the right to set blockOwnerDeletion on what it owns (no finalizer is written).
            assert verb == "update", (resource, verb)
        elif group == "continuum.dev" and not resource.endswith("/status"):
            # No create/delete of what users declare; the GrantLedgers are the operator's own
            # record (made at an Engine's first step, a stale one deleted on its uid).
            allowed = {"get", "list", "watch", "patch"}
            if resource == "grantledgers":
                allowed = {"get", "list", "watch", "create", "delete"}
            assert verb in allowed, (resource, verb)
    assert allows(rules, "continuum.dev", "grantledgers/status", "update")
    assert not allows(rules, "continuum.dev", "engines/status", "update")  # patches only
    # A board's spec.placed (the pods it placed there) is the operator's, its status the agent's.
    assert allows(rules, "continuum.dev", "nodeboards", "patch")
    assert not allows(rules, "continuum.dev", "nodeboards/status", "patch")


def test_the_agent_writes_only_boards_and_its_leases(default_docs: list[dict[str, Any]]) -> None:
    cluster = one(default_docs, "ClusterRole", "-agent")["rules"]
    role = one(default_docs, "Role", "-agent")
    assert role["metadata"]["namespace"] == "continuum-system"  # not the kubelets' Leases
    writes = [(g, r, v) for g, r, v, _ in _expand(cluster) if v not in {"get", "list", "watch"}]
    assert sorted(writes) == [
        ("continuum.dev", "nodeboards", "create"),
        ("continuum.dev", "nodeboards/status", "patch"),
    ]
    assert sorted((r, v) for _, r, v, _ in _expand(role["rules"])) == [
        ("leases", "create"),
        ("leases", "patch"),
    ]
    # No pods at all: RBAC cannot bound a list to its node; its board's spec names its pods.
    assert not [r for g, r, _, _ in _expand(cluster) if g == "" and r.startswith("pods")]
    assert not allows(cluster, "", "secrets", "list")


def test_the_agents_writes_are_bound_to_its_node_by_a_policy_on_by_default(
    default_docs: list[dict[str, Any]],
) -> None:
    policy = one(default_docs, "ValidatingAdmissionPolicy", "-agent-node-binding")
    binding = one(default_docs, "ValidatingAdmissionPolicyBinding", "-agent-node-binding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    written = {r for rule in policy["spec"]["matchConstraints"]["resourceRules"]
               for r in rule["resources"]}  # fmt: skip
    assert written == {"nodeboards", "nodeboards/status", "leases"}
    (condition,) = policy["spec"]["matchConditions"]
    sa = one(default_docs, "ServiceAccount", "-agent")["metadata"]["name"]
    assert f"'system:serviceaccount:continuum-system:{sa}'" in condition["expression"]
    args = one(default_docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0]
    assert "--lease-namespace=continuum-system" in args["args"]
    operator = one(default_docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert "--agent-lease-namespace=continuum-system" in operator["containers"][0]["args"]


def test_uninstall_runs_release_finalizers_as_a_pre_delete_hook_with_its_own_rights(
    helm_bin: Path, default_docs: list[dict[str, Any]]
) -> None:
    """The hook Job stops the operator, then takes the grant finalizer off every Mind: its
    arguments are flags the command accepts naming the chart's Deployment, and its
    ServiceAccount's rights cover exactly what `kube.process.release` calls. All of it is a hook
    resource, made before the Job and deleted once it succeeded."""
    from continuum_operator.kube.process import release

    hooks = [
        d for d in default_docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook")
    ]
    assert sorted(d["kind"] for d in hooks) == [
        "ClusterRole", "ClusterRoleBinding", "Job", "Role", "RoleBinding", "ServiceAccount",
    ]  # fmt: skip
    for doc in hooks:
        notes = doc["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-delete"
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        weight = int(notes["helm.sh/hook-weight"])
        assert weight == 0 if doc["kind"] == "Job" else weight < 0  # rights before the Job

    job = one(default_docs, "Job", "-release-finalizers")
    pod = job["spec"]["template"]["spec"]
    args = _parse(_container(job)["args"])
    assert args.command == "release-finalizers"
    operator = one(default_docs, "Deployment", "-operator")
    ns, name = operator["metadata"]["namespace"], operator["metadata"]["name"]
    assert args.stop_operator == f"{ns}/{name}"
    assert _container(job)["image"] == _container(operator)["image"]
    account = one(default_docs, "ServiceAccount", "-release-finalizers")["metadata"]["name"]
    assert pod["serviceAccountName"] == account

    cluster_rules = one(default_docs, "ClusterRole", "-release-finalizers")["rules"]
    for plural, _finalizer in release.FINALIZED:
        for verb in ("list", "get", "patch"):
            assert allows(cluster_rules, "continuum.dev", plural, verb)
    assert not allows(cluster_rules, "continuum.dev", "minds", "delete")
    ns_rules = one(default_docs, "Role", "-release-finalizers")["rules"]
    assert allows(ns_rules, "apps", "deployments", "patch", name)
    assert not allows(ns_rules, "apps", "deployments", "patch", "someone-else")
    assert allows(ns_rules, "", "pods", "list")
    for binding_kind, role in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(default_docs, binding_kind, "-release-finalizers")
        assert binding["roleRef"]["kind"] == role
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": ns}]

    off = documents(template(helm_bin, {"uninstall": {"releaseFinalizers": False}}).stdout)
    assert not by_kind(off, "Job")

    # It runs where the operator may run (seen: on a KWOK node beside the real one, the hook
    # "completed" without running and every Mind kept her finalizer).
    where = {
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
    }  # fmt: skip
    placed = documents(template(helm_bin, {"operator": where}).stdout)
    hook = one(placed, "Job", "-release-finalizers")["spec"]["template"]["spec"]
    assert {k: hook[k] for k in where} == where


# --- monitoring ---------------------------------------------------------------------------------


def test_monitoring_objects_scrape_the_operator_and_every_engine(
    custom_docs: list[dict[str, Any]],
) -> None:
    monitors = {d["metadata"]["name"]: d for d in by_kind(custom_docs, "ServiceMonitor")}
    assert set(monitors) == {"ctm-operator", "ctm-engines"}
    for monitor in monitors.values():
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
    engines = monitors["ctm-engines"]["spec"]
    assert engines["namespaceSelector"] == {"any": True}
    assert (
        engines["selector"]["matchLabels"]["app.kubernetes.io/managed-by"]
        == engine_objects.MANAGED_BY
    )
    # The engine Service's admin port (metrics are not served to minds on http).
    engine_service = engine_objects.service(
        builders.engine(builders.engine_body()), "u", PodSettings()
    )
    admin = {p["name"]: p["port"] for p in engine_service["spec"]["ports"]}
    assert (
        engines["endpoints"][0]["port"] == "admin" and admin["admin"] == engine_objects.ADMIN_PORT
    )

    pods = {d["metadata"]["name"]: d for d in by_kind(custom_docs, "PodMonitor")}
    assert set(pods) == {"ctm-agents", "ctm-embedlanes"}
    agents = pods["ctm-agents"]["spec"]
    ds = one(custom_docs, "DaemonSet", "-agent")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert agents["selector"]["matchLabels"].items() <= pod_labels.items()
    assert agents["podMetricsEndpoints"][0]["port"] in {p["name"] for p in _container(ds)["ports"]}
    # Lanes: selected by the labels the operator puts on lane pods, scraped on their port.
    lanes = pods["ctm-embedlanes"]["spec"]
    lane = EmbedLane.model_validate(
        yaml.safe_load((ROOT / "examples" / "embedlanes" / "notes.yaml").read_text())
    )
    lane_labels = lane_objects.lane_identity(lane, "uid")[0]["metadata"]["labels"]
    assert lanes["selector"]["matchLabels"].items() <= lane_labels.items()
    assert lanes["podMetricsEndpoints"][0]["path"] == "/metrics"
    relabel = {
        r["targetLabel"]: r["sourceLabels"][0]
        for r in lanes["podMetricsEndpoints"][0]["relabelings"]
    }
    label = lane_objects.LANE_LABEL.replace(".", "_").replace("/", "_")
    assert relabel["lane"] == f"__meta_kubernetes_pod_label_{label}"


def test_the_prometheus_rule_has_the_issues_alerts_on_exported_names(
    custom_docs: list[dict[str, Any]],
) -> None:
    rule = one(custom_docs, "PrometheusRule")
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {
        "ContinuumMemoryModeUnknown",
        "ContinuumBoardStale",
        "ContinuumRelaunchStorm",
        "ContinuumReclaimCycles",
        "ContinuumEstimateErrorHigh",
        "ContinuumUnmutatedChildren",
    }
    documented = (ROOT / "docs" / "metrics.md").read_text()
    for name, alert in alerts.items():
        assert alert["annotations"]["summary"]
        assert alert["labels"]["severity"] in {"warning", "critical"}
        # Each alert's metric is one docs/metrics.md lists.
        metric = re.findall(r"continuum_[a-z_]+", alert["expr"])[0]
        assert f"`{metric}`" in documented, f"{name}: {metric} is not in docs/metrics.md"


def test_the_dashboard_is_valid_json_in_an_optional_configmap(
    custom_docs: list[dict[str, Any]], default_docs: list[dict[str, Any]]
) -> None:
    assert not [d for d in by_kind(default_docs, "ConfigMap")]
    cm = one(custom_docs, "ConfigMap", "-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["continuum.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "continuum.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    documented = (ROOT / "docs" / "metrics.md").read_text()
    for expr in exprs:
        for word in re.findall(r"continuum_[a-z_]+", expr):
            # A histogram is documented once, by its name; queries use its series' suffixes.
            base = re.sub(r"_(bucket|sum|count)$", "", word)
            assert f"`{word}`" in documented or f"`{base}` | histogram" in documented, (
                f"dashboard uses {word}, not in docs/metrics.md"
            )


# --- bad values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicas": 0}}, "/operator/replicas"),
        ({"operator": {"gpuSharing": "nvidia"}}, "/operator/gpuSharing"),
        ({"operator": {"gpuClaims": "cdi"}}, "/operator/gpuClaims"),
        ({"operator": {"replicsa": 2}}, "replicsa"),
        ({"operator": {"laneCpu": "two"}}, "/operator/laneCpu"),
        ({"agent": {"leaseSeconds": "forty"}}, "/agent/leaseSeconds"),
        ({"webhook": {"timeoutSeconds": 60}}, "/webhook/timeoutSeconds"),
        ({"webhook": {"clientConfig": "dns"}}, "/webhook/clientConfig"),
        ({"uninstall": {"timeoutSeconds": 0}}, "/uninstall/timeoutSeconds"),
        ({"webhook": {"enabled": True, "certificates": {"mode": "secret"}}}, "secretName"),
        ({"webhook": {"certificates": {"mode": "vault"}}}, "/webhook/certificates/mode"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
        ({"images": {"operator": {"repository": ""}}}, "/images/operator/repository"),
    ],
)
def test_bad_values_are_refused_by_the_schema_with_the_fields_path(
    helm_bin: Path, values: dict[str, Any], message: str
) -> None:
    proc = template(helm_bin, values, check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"operator": {"replicas": 2, "leaderElection": {"enabled": False}}},
            "operator.replicas > 1 needs operator.leaderElection.enabled",
        ),
        (
            {"agent": {"intervalSeconds": 30, "leaseSeconds": 20}},
            "must exceed agent.intervalSeconds",
        ),
        (
            # The leader stops writing 2 s before its Lease may be taken (kube/process/leader.py).
            {"operator": {"leaderElection": {"leaseDurationSeconds": 15, "renewSeconds": 20}}},
            "operator.leaderElection.renewSeconds (20) must be under "
            "operator.leaderElection.leaseDurationSeconds (15) less the leader's margin of 2 s",
        ),
        (
            {"operator": {"leaderElection": {"leaseDurationSeconds": 15, "renewSeconds": 13}}},
            "(under 13 s)",
        ),
    ],
)
def test_values_the_schema_cannot_judge_alone_fail_with_a_sentence(
    helm_bin: Path, values: dict[str, Any], message: str
) -> None:
    proc = template(helm_bin, values, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_the_chart_and_the_operator_refuse_the_same_leader_timings(helm_bin: Path) -> None:
    """The chart's check and the operator's (cli/operator_sections.py) agree at the edge: a
    release the chart renders starts, one it refuses would not."""
    from continuum_operator.cli.operator_sections import refusal

    for duration, renew in [(15, 12.9), (15, 13), (6, 4.79), (6, 4.8), (1, 0.79), (1, 0.8)]:
        values = {
            "operator": {
                "leaderElection": {"leaseDurationSeconds": duration, "renewSeconds": renew}
            }
        }
        proc = template(helm_bin, values, check=False)
        args = _parse(
            ["operator", f"--leader-lease-duration={duration}", f"--leader-renew={renew}"]
        )
        operator_refuses = refusal(args) is not None
        assert (proc.returncode != 0) == operator_refuses, (duration, renew, proc.stderr)


MAP = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"


def test_the_api_server_puts_the_grant_finalizer_on_minds_where_it_can(helm_bin: Path) -> None:
    """A MutatingAdmissionPolicy (Kubernetes 1.36+) adds the operator's own finalizer to each
    Mind as she is created; on an API server without that API the chart leaves it out (the
    operator adds it when she is granted, tests/unit/kube/grants/test_grant_finalizer.py)."""
    docs = documents(template(helm_bin, api_versions=[MAP]).stdout)
    policy = one(docs, "MutatingAdmissionPolicy", "-mind-grant-finalizer")
    binding = one(docs, "MutatingAdmissionPolicyBinding", "-mind-grant-finalizer")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": ["continuum.dev"], "apiVersions": ["*"], "operations": ["CREATE"],
         "resources": ["minds"]}
    ]  # fmt: skip
    expression = policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert f'"{mind_writes.FINALIZER}"' in expression and f"'{mind_writes.FINALIZER}'" in condition
    assert policy["spec"]["failurePolicy"] == "Ignore"  # a Mind is never refused for it
    assert by_kind(documents(template(helm_bin).stdout), "MutatingAdmissionPolicy") == []
    off = {"grantFinalizerPolicy": {"enabled": False}}
    assert by_kind(documents(template(helm_bin, off, api_versions=[MAP]).stdout),
                   "MutatingAdmissionPolicy") == []  # fmt: skip


def test_a_minds_childs_cpu_is_guarded_against_in_place_resize_with_the_webhook(
    helm_bin: Path, default_docs: list[dict[str, Any]]
) -> None:
    """The children's webhook sees a pod's creation only; pods/resize could give a child its
    CPU weight back (the refusal itself: tests/e2e/test_boundaries.py)."""
    policy = one(default_docs, "ValidatingAdmissionPolicy", "-children-cpu")
    binding = one(default_docs, "ValidatingAdmissionPolicyBinding", "-children-cpu")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert [(r["operations"], r["resources"]) for r in rules] == [(["UPDATE"], ["pods/resize"])]
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert f'"{PodSettings().children_priority_class}"' in condition
    renamed = {"priorityClasses": {"childrenName": "kids"}}
    docs = documents(template(helm_bin, renamed).stdout)
    assert '"kids"' in one(docs, "ValidatingAdmissionPolicy", "-children-cpu")["spec"][
        "matchConditions"][0]["expression"]  # fmt: skip
    for off in (
        {"webhook": {"enabled": False}},
        {"webhook": {"cpuResizePolicy": {"enabled": False}}},
    ):
        names = [d["metadata"]["name"] for d in documents(template(helm_bin, off).stdout)]
        assert not [n for n in names if n.endswith("-children-cpu")], off
