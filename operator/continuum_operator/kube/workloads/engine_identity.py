"""An engine pod's identity and its doors, as Kubernetes objects: plain dicts, no API calls.

Its ServiceAccount may read its own Engine and its own GrantLedger and write only the Engine's
`status.runtime` (a Role bound by name). It may not write the ledger at all: the operator's
leader alone does, and this Role is what stops a compromised engine from granting minds slots
(docs/security.md "The ledger"). A ClusterRoleBinding to `system:auth-delegator` lets its
gateway review minds' tokens; a NetworkPolicy admits its serving port to the namespaces it
serves and its admin port to labelled monitoring namespaces (docs/gateway.md,
docs/security.md). The embed lanes use the same binding and policy (`kube.workloads.lane_objects`).
Neighbours: `kube.workloads.engine_objects` (labels, owner, ports).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.workloads.engine_objects import (
    ADMIN_PORT,
    AUTH_DELEGATOR,
    SCRAPE_LABEL,
    Manifest,
    labels,
    owner_reference,
    selector,
    service_account_name,
)
from continuum_operator.model.engine import Engine
from continuum_operator.model.grant_ledger import GrantLedger

__all__ = [
    "door_policy",
    "engine_rbac",
    "namespaces_named",
    "network_policy",
    "own_account",
    "token_review_binding",
    "token_review_binding_name",
]


def own_account(
    meta: Manifest, plural: str, name: str, read_verbs: list[str], *, also_reads: Sequence[str] = ()
) -> list[Manifest]:
    """A pod's ServiceAccount, a Role that reads one object of `plural` by name and gets and
    patches its status (a Role restricted by resourceNames: RBAC allows a watch with a field
    selector on that name), and their binding, all with `meta` (name, namespace, labels,
    owner). `also_reads`: plurals of objects of the same name it reads with `read_verbs` and
    may not write (nor their status), as an engine its GrantLedger."""
    account, ns = meta["name"], meta["namespace"]
    reads = [
        {"apiGroups": ["continuum.dev"], "resources": [other], "resourceNames": [name],
         "verbs": list(read_verbs)}
        for other in also_reads
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [
                {"apiGroups": ["continuum.dev"], "resources": [plural], "resourceNames": [name],
                 "verbs": read_verbs},
                {"apiGroups": ["continuum.dev"], "resources": [f"{plural}/status"],
                 "resourceNames": [name], "verbs": ["get", "patch"]},
                *reads,
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
        },
    ]  # fmt: skip


def engine_rbac(engine: Engine, uid: str) -> list[Manifest]:
    """The engine pod's identity: it reads its own Engine (plan) and GrantLedger (grants) and
    writes the Engine's status.runtime.

    A ServiceAccount, a Role limited by name to this one Engine and its GrantLedger (of the
    same name), and their binding, all owned by the Engine. `continuum engine --engine NS/NAME`
    watches the GrantLedger with a field selector on its name, which RBAC allows for a Role
    restricted by resourceNames; the Role has no verb that writes the ledger. And a
    ClusterRoleBinding to `system:auth-delegator` (TokenReviews are cluster-scoped): the
    gateway reviews each mind's token. A cluster-scoped object cannot be owned by a namespaced
    one, so the binding carries the engine's labels instead of an owner.
    """
    name = service_account_name(engine)
    meta = {
        "name": name,
        "namespace": engine.metadata.namespace,
        "labels": labels(engine),
        "ownerReferences": [owner_reference(engine, uid)],
    }
    return [
        *own_account(
            meta,
            "engines",
            engine.metadata.name,
            ["get", "list", "watch"],
            also_reads=[GrantLedger.PLURAL],
        ),
        token_review_binding(
            token_review_binding_name(engine),
            {**labels(engine), "continuum.dev/engine-namespace": engine.metadata.namespace},
            name,
            engine.metadata.namespace,
        ),
    ]


def token_review_binding_name(engine: Engine) -> str:
    """One per engine: `:` cannot appear in a namespace or a name, so two never collide."""
    return f"continuum-engine-tokenreview:{engine.metadata.namespace}:{engine.metadata.name}"


def token_review_binding(
    name: str, binding_labels: Mapping[str, str | None], account: str, namespace: str | None
) -> Manifest:
    """A ClusterRoleBinding of one ServiceAccount to `system:auth-delegator`, so its pod may
    review callers' tokens (TokenReviews are cluster-scoped): an engine's, an embed lane's.
    Cluster-scoped, it cannot be owned by the namespaced object it serves: its labels name that
    object instead, and it is left behind when the object is deleted (the operator deletes no
    ClusterRoleBinding: RBAC cannot limit that right to the bindings it made)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": dict(binding_labels)},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": AUTH_DELEGATOR,
        },
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    }


def network_policy(engine: Engine, uid: str, pods: PodSettings) -> Manifest:
    """Who reaches the engine's pod: its own and its allowed namespaces, on the gateway's port
    only (llama-server listens on loopback inside the pod); the admin port only from namespaces
    labelled `continuum.dev/scrape-engines=true`. Enforced where the cluster's network plugin
    enforces NetworkPolicies (docs/gateway.md)."""
    allowed = [n for n in engine.spec.allowed_namespaces if n != "*"]
    minds: Manifest = (
        {"namespaceSelector": {}}
        if "*" in engine.spec.allowed_namespaces
        else namespaces_named([engine.metadata.namespace, *allowed])
    )
    metadata = {
        "name": engine.metadata.name,
        "namespace": engine.metadata.namespace,
        "labels": labels(engine),
        "ownerReferences": [owner_reference(engine, uid)],
    }
    return door_policy(metadata, selector(engine), minds, pods.port)


def door_policy(
    metadata: Manifest, pod_selector: Mapping[str, str], callers: Manifest, port: int
) -> Manifest:
    """A NetworkPolicy of a serving pod (an engine's, an embed lane's): `callers` (a `from`
    peer) on the serving `port`, namespaces labelled `continuum.dev/scrape-engines=true` on
    ADMIN_PORT, nothing else."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": dict(pod_selector)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [callers], "ports": [{"protocol": "TCP", "port": port}]},
                {
                    "from": [{"namespaceSelector": {"matchLabels": {SCRAPE_LABEL: "true"}}}],
                    "ports": [{"protocol": "TCP", "port": ADMIN_PORT}],
                },
            ],
        },
    }


def namespaces_named(names: Iterable[str | None]) -> Manifest:
    """A NetworkPolicy peer: the pods of these namespaces, by their name label."""
    return {
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "In",
                    "values": sorted({n for n in names if n}),
                }
            ]
        }
    }
