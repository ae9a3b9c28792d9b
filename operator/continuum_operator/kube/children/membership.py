"""What makes a pod a mind's child, and what the children's webhook does to one (docs/children.md).

A pod is a mind's child when her service account created it (`mind_of_creator`), it carries her
label, or a Mind owns it (`mind_of`). `mutate` gives it the children's priority class, the least
CPU weight (a minimal CPU request, no CPU limit) and the mark for the runner inside the pod
(`continuum run`): the annotation `continuum.dev/process-class` and the variable
`CONTINUUM_PROCESS_CLASS`, both `background`. Pure: a pod in, the mutated pod and notes out.
Neighbours: `kube.children.webhook` (serves it, counts the children it missed).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.client.body import bodies, object_in
from continuum_operator.model.base import GROUP
from continuum_operator.model.json_body import object_at

__all__ = [
    "BACKGROUND",
    "CLASS_ANNOTATION",
    "CLASS_ENV",
    "MIND_LABEL",
    "SERVICE_ACCOUNT_PREFIX",
    "SYSTEM_ACCOUNTS",
    "Mutation",
    "is_marked",
    "mind_of",
    "mind_of_creator",
    "mutate",
]

MIND_LABEL = "continuum.dev/mind"
"""On a pod a mind spawns, the mind's name: the contract the webhook and the count rely on."""
CLASS_ANNOTATION = "continuum.dev/process-class"
CLASS_ENV = "CONTINUUM_PROCESS_CLASS"
BACKGROUND = "background"

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
SYSTEM_ACCOUNTS = f"{SERVICE_ACCOUNT_PREFIX}kube-system:"


def mind_of_creator(username: str | None, is_mind: Callable[[str], bool]) -> str | None:
    """The mind whose service account created a pod: `system:serviceaccount:NS:NAME` speaks for
    Mind NS/NAME (as the gateway reads a token, docs/gateway.md), if that Mind exists. A child
    is known by who made it, so leaving the label off does not make it an ordinary pod."""
    if not username or not username.startswith(SERVICE_ACCOUNT_PREFIX):
        return None
    namespace, _, name = username[len(SERVICE_ACCOUNT_PREFIX) :].partition(":")
    if not namespace or not name or ":" in name or not is_mind(f"{namespace}/{name}"):
        return None
    return name


def mind_of(pod: Mapping[str, object]) -> str | None:
    """The mind whose child this pod is: its label, else an owner reference to a Mind."""
    meta = object_at(pod, "metadata")
    name = object_at(meta, "labels").get(MIND_LABEL)
    if name:
        return str(name)
    for ref in bodies(meta.get("ownerReferences")):
        if ref.get("kind") == "Mind" and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return str(ref.get("name"))
    return None


def is_marked(pod: Mapping[str, object]) -> bool:
    return object_at(pod, "metadata", "annotations").get(CLASS_ANNOTATION) == BACKGROUND


@dataclass(frozen=True, slots=True)
class Mutation:
    pod: dict[str, object]
    """The pod as it is admitted."""
    notes: tuple[str, ...] = ()
    """What was overridden, returned to the client as admission warnings."""


def _without_cpu(resources: dict[str, object], side: str) -> str | None:
    """Removes `resources[side].cpu`; returns what it was."""
    values = resources.get(side)
    if not isinstance(values, dict) or "cpu" not in values:
        return None
    removed = str(values.pop("cpu"))
    if not values:
        del resources[side]
    return removed


def mutate(
    pod: Mapping[str, object],
    pods: PodSettings,
    children: ChildrenSettings,
    creator_mind: str | None = None,
) -> Mutation | None:
    """A mind's child pod as it must run; None for a pod of no mind (left as it is).

    `creator_mind`: the mind whose service account creates the pod (`mind_of_creator`), a
    child whatever its labels say. Idempotent: a mutated pod mutates to itself with no notes,
    so the webhook may be called again (reinvocation) at no cost.
    """
    mind = mind_of(pod) or creator_mind
    if mind is None:
        return None
    new: dict[str, object] = copy.deepcopy(dict(pod))
    notes: list[str] = []
    meta = object_in(new, "metadata")
    labels = object_in(meta, "labels")
    if MIND_LABEL not in labels:  # an owned or made child gets the label: the count watches it
        if LABEL_VALUE.fullmatch(mind):
            labels[MIND_LABEL] = mind
        else:  # a label would refuse the pod: it is admitted without, and not counted if missed
            notes.append(f"mind name {mind} is no label value: {MIND_LABEL} not set")
    object_in(meta, "annotations")[CLASS_ANNOTATION] = BACKGROUND
    spec = object_in(new, "spec")
    asked = spec.get("priorityClassName")
    if asked and asked != pods.children_priority_class:
        notes.append(f"priorityClassName {asked} replaced by {pods.children_priority_class}")
    # The Priority admission plugin resolved the class before webhooks run: the integer and the
    # preemption policy are set with the name, as that plugin would have set them.
    spec["priorityClassName"] = pods.children_priority_class
    spec["priority"] = pods.children_priority
    spec["preemptionPolicy"] = "Never"
    pod_resources = spec.get("resources")
    if isinstance(pod_resources, dict):
        # Pod-level resources would set the pod's cgroup weight and cap: drop their CPU, so the
        # containers' minimal requests decide.
        for side in ("limits", "requests"):
            if (was := _without_cpu(pod_resources, side)) is not None:
                notes.append(f"pod-level CPU {side[:-1]} {was} removed")
        if not pod_resources:
            del spec["resources"]
    for kind in ("initContainers", "containers"):
        listed = spec.get(kind)
        for container in listed if isinstance(listed, list) else []:
            if not isinstance(container, dict):
                continue
            resources = object_in(container, "resources")
            name = container.get("name")
            if (was := _without_cpu(resources, "limits")) is not None:
                notes.append(f"container {name}: CPU limit {was} removed")
            requests = object_in(resources, "requests")
            asked = requests.get("cpu")
            if asked is not None and str(asked) != children.cpu_request:
                # Said, so a LimitRange's refusal of the request ("minimum cpu ... is 100m,
                # but request is 1m") names who wrote 1m into a pod that asked for more.
                notes.append(
                    f"container {name}: CPU request {asked} replaced by {children.cpu_request} "
                    "(a mind's child, docs/children.md)"
                )
            requests["cpu"] = children.cpu_request
            env = [e for e in bodies(container.get("env")) if e.get("name") != CLASS_ENV]
            container["env"] = [*env, {"name": CLASS_ENV, "value": BACKGROUND}]
    return Mutation(new, tuple(notes))
