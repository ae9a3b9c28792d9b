"""A mind's workloads: the pods her Deployments, Jobs, StatefulSets, CronJobs... make are her
children too (docs/children.md, "Pods her workloads make").

A controller (the ReplicaSet's, the Job's) creates those pods from a template, as
`kube-system`'s accounts, not hers: the pod webhook cannot tell them from anyone's by who
creates them. So the template is mutated where she writes it: a workload her service account
creates, or whose pod template it changes, gets in its template what her own pod gets
(`children.mutate`: the children's class, the least CPU weight, the mark and her label). Its
pods then carry her label, and the pod webhook sees them as hers as well.

Pure: `mutate_workload` (a workload in, the mutated one and notes out) and
`workloads_webhook` (the configuration's entry). `register` wires them into kopf.
Neighbours: `kube.children.membership` (a pod's mutation), `kube.children.webhook` (the
configuration, the pod handler).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children.membership import (
    SERVICE_ACCOUNT_PREFIX,
    SYSTEM_ACCOUNTS,
    Mutation,
    mind_of_creator,
    mutate,
)
from continuum_operator.kube.client.body import object_in
from continuum_operator.model.base import GROUP

if TYPE_CHECKING:
    import kopf

    from continuum_operator.kube.state.mind_cache import MindCache

__all__ = [
    "HANDLER_ID",
    "WORKLOADS",
    "answer",
    "creator_mind",
    "mutate_workload",
    "register",
    "workloads_webhook",
]

HANDLER_ID = "mind-workloads"
"""kopf's id of the workloads' handler: the last part of its webhook's URL path."""

WORKLOADS: dict[tuple[str, str], tuple[str, ...]] = {
    ("apps", "deployments"): ("spec", "template"),
    ("apps", "replicasets"): ("spec", "template"),
    ("apps", "statefulsets"): ("spec", "template"),
    ("apps", "daemonsets"): ("spec", "template"),
    ("batch", "jobs"): ("spec", "template"),
    ("batch", "cronjobs"): ("spec", "jobTemplate", "spec", "template"),
    ("", "replicationcontrollers"): ("spec", "template"),
    ("", "podtemplates"): ("template",),
}
"""The built-in kinds whose controllers make pods from a template, and where the template is."""

MATCH_CONDITION = (
    f"request.userInfo.username.startsWith('{SERVICE_ACCOUNT_PREFIX}') && "
    f"!request.userInfo.username.startsWith('{SYSTEM_ACCOUNTS}')"
)
"""Workloads a service account outside kube-system writes (a mind's may be among them; the
handler asks its Minds). The controllers' own writes (a Deployment's ReplicaSet) are not sent:
they copy a template that was mutated where she wrote it."""


def _template(obj: Mapping[str, object], path: tuple[str, ...]) -> dict[str, object] | None:
    node: object = obj
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, dict) else None


def mutate_workload(
    resource: tuple[str, str],
    obj: Mapping[str, object],
    old: Mapping[str, object] | None,
    pods: PodSettings,
    children: ChildrenSettings,
    creator_mind: str | None,
) -> Mutation | None:
    """The workload with its pod template as her child must run; None when it is not hers to
    mutate: no mind wrote it (`creator_mind`), an update that leaves the template as it was (a
    scale, a label: whoever made the template decided its pods), or a kind not in WORKLOADS.

    The template gets what `children.mutate` gives a pod, except the resolved `priority` and
    `preemptionPolicy`: the Priority admission plugin sets those on each pod from the class
    name, and refuses a pod whose given integer disagrees with its class.
    """
    path = WORKLOADS.get(resource)
    if creator_mind is None or path is None:
        return None
    if old is not None and _template(old, path) == _template(obj, path):
        return None
    new: dict[str, object] = copy.deepcopy(dict(obj))
    template = _template(new, path)
    if template is None:  # the API server's validation refuses it; nothing to mutate
        return None
    as_pod = {"metadata": template.get("metadata") or {}, "spec": template.get("spec") or {}}
    mutation = mutate(as_pod, pods, children, creator_mind)
    assert mutation is not None  # a creator mind makes every pod a child
    spec = object_in(mutation.pod, "spec")
    spec.pop("priority", None)
    spec.pop("preemptionPolicy", None)
    template["metadata"] = mutation.pod["metadata"]
    template["spec"] = spec
    notes = tuple(f"pod template: {note}" for note in mutation.notes)
    return Mutation(new, notes)


def workloads_webhook(client: Mapping[str, object], timeout_seconds: int) -> dict[str, object]:
    """The configuration's entry that sends the workloads a service account writes to
    `client` (the pods' client config, its path ending in this handler's id)."""
    by_group: dict[str, list[str]] = {}
    for group, plural in WORKLOADS:
        by_group.setdefault(group, []).append(plural)
    return {
        "name": f"workloads.children.{GROUP}",
        "clientConfig": client,
        "rules": [
            {
                "apiGroups": [group],
                "apiVersions": ["v1"],
                "resources": plurals,
                "operations": ["CREATE", "UPDATE"],
                "scope": "Namespaced",
            }
            for group, plurals in by_group.items()
        ],
        "matchConditions": [{"name": "a-service-accounts-write", "expression": MATCH_CONDITION}],
        "failurePolicy": "Ignore",
        "sideEffects": "None",
        "timeoutSeconds": timeout_seconds,
        "admissionReviewVersions": ["v1"],
        "reinvocationPolicy": "IfNeeded",
        "matchPolicy": "Equivalent",
    }


def creator_mind(userinfo: Mapping[str, object] | None, minds: MindCache) -> str | None:
    """The Mind whose service account sends the request (`children.mind_of_creator`)."""
    username = str((userinfo or {}).get("username") or "")
    return mind_of_creator(username, lambda key: key in minds.minds)


def answer(patch: kopf.Patch, warnings: list[str], mutation: Mutation) -> None:
    """The admission's answer: the object as mutated (kopf makes the JSON patch from the
    difference), its notes as warnings the client prints."""
    warnings.extend(mutation.notes)

    def replace(raw: kopf.RawBody) -> None:
        # kopf hands the object as the plain dict it diffs: replaced in place, whole.
        body = cast("dict[str, object]", raw)
        body.clear()
        body.update(copy.deepcopy(mutation.pod))

    patch.fns.append(replace)


def register(
    registry: kopf.OperatorRegistry,
    pods: PodSettings,
    children: ChildrenSettings,
    minds: MindCache,
) -> None:
    """One mutating handler, under one id, for every kind in WORKLOADS. Their pods pass the
    pod handler as well (they carry her label), which counts them."""
    import kopf

    def workload(
        body: kopf.Body,
        patch: kopf.Patch,
        warnings: list[str],
        resource: kopf.Resource,
        userinfo: kopf.UserInfo | None = None,
        old: kopf.Body | None = None,
        **_: object,
    ) -> None:
        key = (resource.group, resource.plural)
        was = dict(old) if old is not None else None
        creator = creator_mind(userinfo, minds)
        mutation = mutate_workload(key, dict(body), was, pods, children, creator)
        if mutation is not None:
            answer(patch, warnings, mutation)

    for group, plural in WORKLOADS:
        kopf.on.mutate(group, "v1", plural, id=HANDLER_ID, operations=["CREATE", "UPDATE"],
                       ignore_failures=True, registry=registry)(workload)  # fmt: skip
