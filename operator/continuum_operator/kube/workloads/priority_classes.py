"""The PriorityClasses the operator installs: the engines' (above the minds they serve and
ordinary pods), the minds' and their children's (the lowest; neither ever preempts). Plain
dicts, no API calls. Neighbours: `kube.base.settings` (their names and values, `PodSettings`),
`kube.engines.loop` (installs them at startup), `kube.children.webhook` (installs them before the
children's webhook).
"""

from __future__ import annotations

from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.workloads.engine_objects import MANAGED_BY, Manifest

__all__ = ["priority_classes"]


def priority_classes(pods: PodSettings) -> list[Manifest]:
    """The engines' class, the minds' and their children's, installed by the operator at startup."""
    return [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {
                "name": pods.engine_priority_class,
                "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
            },
            "value": pods.engine_priority,
            "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": "continuum engines: above the minds they serve and ordinary pods.",
        },
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {
                "name": pods.mind_priority_class,
                "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
            },
            "value": pods.mind_priority,
            "globalDefault": False,
            "preemptionPolicy": "Never",
            "description": "continuum minds: below the engines that serve them; never preempt.",
        },
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {
                "name": pods.children_priority_class,
                "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
            },
            "value": pods.children_priority,
            "globalDefault": False,
            "preemptionPolicy": "Never",
            "description": "a mind's child pods (builds, test runs): the lowest; never preempt.",
        },
    ]
