"""kopf watch handlers: each one only records what it saw in the cache and wakes the loop.

The operator watches Engines and their GrantLedgers, EmbedLanes, NodeBoards, the agents' Leases,
Nodes, and the Deployments, Services and facts Jobs it owns. No handler decides or writes
anything (the loops do, `kube.engines.loop`, `kube.grants.loop`), so kopf keeps no state on the
objects: no finalizers, no progress annotations.
Handlers are coroutines, so the cache is only touched from the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import kopf

from continuum_operator.core.heartbeat import AGENT_LEASE_SELECTOR
from continuum_operator.kube.ledger import cached
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.workloads.engine_objects import MANAGED_BY
from continuum_operator.model.base import GROUP, VERSION, label_selector

__all__ = ["registry_for", "select_on_server"]


def _deleted(event: kopf.RawEvent) -> bool:
    return event.get("type") == "DELETED"


def select_on_server(
    settings: kopf.OperatorSettings, engine_labels: Mapping[str, str] | None = None
) -> None:
    """Label selectors the API server applies to the watches, not kopf after receiving: the
    kubelets' node Leases (a hundred renewals a second at 1,000 nodes) and every Deployment,
    Job and Service of the cluster would otherwise each cross the wire and kopf's machinery
    only to be dropped by a handler's filter (bench/scale.py, 1,000 nodes at rest: 22% of a
    core before, 7% after).

    The Engines of `--engine-selector` likewise, and for more than the traffic: an Engine
    relabelled out of the selection reaches a selected watch as DELETED (the API server sends
    the change of selection as one), so this operator forgets it and stops deciding it. A
    handler's filter never calls the handler for it: the cache kept the Engine as it last
    matched, and two operators decided it."""
    watching = settings.watching.label_selectors
    watching["coordination.k8s.io", "leases"] = AGENT_LEASE_SELECTOR
    for group, plural in (("apps", "deployments"), ("batch", "jobs"), ("v1", "services")):
        watching[group, plural] = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    if engine_labels:
        watching[GROUP, "engines"] = label_selector(engine_labels)


def registry_for(
    cache: Cache, engine_labels: Mapping[str, str] | None = None
) -> kopf.OperatorRegistry:
    """The watches; `engine_labels` limits the Engines this operator serves (equality only)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: object) -> kopf.ConnectionInfo | None:
        # A kubeconfig when one is named (local runs, tests); the pod's ServiceAccount in a
        # cluster (the chart's Deployment), where no kubeconfig exists.
        if os.environ.get("KUBECONFIG"):
            return kopf.login_with_kubeconfig(settings=settings)
        return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: object) -> None:
        settings.peering.standalone = (
            True  # leadership is a coordination Lease (kube.process.leader)
        )
        settings.posting.enabled = False  # events are posted by the loop, on transitions only
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        select_on_server(settings, engine_labels)

    @kopf.on.event(group=GROUP, version=VERSION, plural="engines", registry=registry)
    async def engine(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_engine(event["object"], _deleted(event))

    @kopf.on.event(group=GROUP, version=VERSION, plural=cached.PLURAL, registry=registry)
    async def grantledger(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_ledger(event["object"], _deleted(event))

    @kopf.on.event(group=GROUP, version=VERSION, plural="embedlanes", registry=registry)
    async def embedlane(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_lane(event["object"], _deleted(event))

    @kopf.on.event(group=GROUP, version=VERSION, plural="nodeboards", registry=registry)
    async def board(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_board(event["object"], _deleted(event))

    @kopf.on.event(
        group="coordination.k8s.io",
        version="v1",
        plural="leases",
        registry=registry,
        when=lambda namespace, **_: namespace == cache.lease_namespace,
    )
    async def lease(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_lease(event["object"], _deleted(event))

    @kopf.on.event(group="", version="v1", plural="nodes", registry=registry)
    async def node(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_node(event["object"], _deleted(event))

    @_watch_managed("apps", "deployments", registry)
    async def deployment(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_deployment(event["object"], _deleted(event))

    @_watch_managed("batch", "jobs", registry)
    async def job(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_job(event["object"], _deleted(event))

    @_watch_managed("", "services", registry)
    async def service(event: kopf.RawEvent, **_: object) -> None:
        cache.observe_service(event["object"], _deleted(event))

    return registry


def _watch_managed(
    group: str, plural: str, registry: kopf.OperatorRegistry
) -> kopf.on.WatchingDecorator:
    """A watch of one kind of the objects the operator made: those labelled as managed by it."""
    return kopf.on.event(
        group=group,
        version="v1",
        plural=plural,
        registry=registry,
        labels={"app.kubernetes.io/managed-by": MANAGED_BY},
    )
