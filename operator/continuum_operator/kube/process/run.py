"""`continuum operator`: kopf's watches and the decision loop, together, until stopped.

Runs standalone (no kopf peering: docs/design.md chooses a coordination Lease for leadership, which
`kube.process.leader` holds), cluster-wide, with the settings `cli.operator` reads from its flags
(every setting of `kube.base.settings` that an operator of a cluster would tune has one; tests use
short timings). kopf and the Kubernetes client are imported only when the operator starts, so the
other subcommands stay quick.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.children import webhook

if TYPE_CHECKING:
    from continuum_operator.kube.base.metrics import OperatorMetrics
    from continuum_operator.kube.base.readiness import Readiness
    from continuum_operator.kube.client.api import KubeApi
    from continuum_operator.kube.client.async_api import AsyncKubeApi
    from continuum_operator.kube.state.cache import Cache
    from continuum_operator.kube.state.mind_cache import MindCache

__all__ = ["join_caches", "serve"]


def join_caches(engines: Cache, minds: MindCache) -> None:
    """The one place the caches are wired to each other (no loop rewires another's objects):
    an Engine's change wakes the grants' queue (the Minds' cache's, which the grants loop
    drains), and the Engines' cache learns whether any TokenQuota exists (an Engine's ledger
    then changes every quota's room)."""
    engines.grants_queue = minds.queue
    engines.quotas_read = lambda: bool(minds.quotas)


async def serve(
    settings: OperatorSettings,
    kubeconfig: str | None,
    metrics_port: int = 0,
    engine_labels: dict[str, str] | None = None,
) -> int:
    # Imported here: `continuum plan` and friends need not load kopf and the Kubernetes client.
    from continuum_operator.kube.base.metrics import OperatorMetrics
    from continuum_operator.kube.base.readiness import MINDS_LISTED, WEBHOOK_SERVING, Readiness
    from continuum_operator.kube.client.api import KubeApi
    from continuum_operator.kube.client.async_api import AsyncKubeApi

    metrics = OperatorMetrics()
    # With the children's webhook, ready (`/readyz`) once it serves knowing every Mind.
    ready = Readiness((MINDS_LISTED, WEBHOOK_SERVING) if settings.children.webhook else ())
    if metrics_port:
        metrics.serve(metrics_port, ready)
    # The loops' calls are awaited on the event loop (`kube.client.async_api`); the leader Lease's
    # go out blocking, from a thread of its own (`kube.process.leader.lead`), so that no stretch of
    # work on the loop can delay a renewal.
    api = await AsyncKubeApi.connect(kubeconfig, meter=metrics)
    lease_api = KubeApi(kubeconfig, meter=metrics)
    try:
        return await _operate(settings, api, lease_api, metrics, ready, engine_labels)
    finally:
        await api.close()


async def _operate(
    settings: OperatorSettings,
    api: AsyncKubeApi,
    lease_api: KubeApi,
    metrics: OperatorMetrics,
    ready: Readiness,
    engine_labels: dict[str, str] | None,
) -> int:
    import kopf

    from continuum_operator.kube.process.leader import Elector, lead
    from continuum_operator.kube.state.cache import Cache
    from continuum_operator.kube.state.handlers import registry_for
    from continuum_operator.kube.state.mind_cache import MindCache
    from continuum_operator.kube.state.mind_cache import register as register_minds

    freshness = settings.freshness
    # One clock for the cache and every loop (`_reconcilers`): freshness is `now` minus when a
    # renewal was seen.
    cache = Cache(
        lease_namespace=freshness.lease_namespace,
        max_lease_seconds=freshness.max_ttl_seconds,
        clock=time.time,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registry = registry_for(cache, engine_labels)

    # Once kopf runs it answers SIGTERM and SIGINT itself (its handlers replace the ones above).
    # Its cleanup stops the loops: else it waits 5 s for them as hung tasks, then cancels them
    # mid-pass, and the Lease is handed over only after.
    @kopf.on.cleanup(registry=registry)
    def stop_the_loops(**_: object) -> None:
        stop.set()

    # Minds through their engine's ledger; only the leader decides and writes.
    mind_cache = MindCache()
    join_caches(cache, mind_cache)
    # A pod her service account creates is her child (`children.mind_of_creator`).
    webhook.register(registry, api, settings.pods, settings.children, metrics, mind_cache, ready)
    register_minds(registry, mind_cache)
    elector = Elector(lease_api, settings.leader, on_change=metrics.set_leader)
    reconcilers = _reconcilers(
        api, settings, cache, mind_cache, elector.is_leader, metrics, engine_labels
    )
    decisions = asyncio.create_task(lead(elector, stop, [r.run for r in reconcilers]))
    decisions.add_done_callback(lambda _: stop.set())  # a lost Lease stops this replica
    try:
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=True,
            stop_flag=stop,
        )
    finally:
        stop.set()
        code = await decisions
    return code


def _reconcilers(
    api: AsyncKubeApi,
    settings: OperatorSettings,
    cache: Cache,
    mind_cache: MindCache,
    may_write: Callable[[], bool],
    metrics: OperatorMetrics,
    engine_labels: dict[str, str] | None,
) -> list[Reconciling]:
    """Every reconciler on the kernel, wired here and nowhere else: the cache's clock, the
    leader's gate (which the kernel asks at each write) and each one's kernel settings, all from
    the one settings object (`OperatorSettings.kernels`)."""
    from continuum_operator.kube.engines.loop import Loop
    from continuum_operator.kube.grants.loop import GrantsLoop
    from continuum_operator.kube.lanes.loop import LaneLoop
    from continuum_operator.kube.nodes.placed_pods import PlacedPods

    clock = cache.clock
    # Every write the loops send, refused at the call once this replica no longer leads (the
    # kernel also asks before each key's writes; the webhook's writes are every replica's).
    api = api.writing_while(may_write)
    engines = Loop(api, settings, cache, clock=clock, metrics=metrics, may_write=may_write)
    kernels = settings.kernels
    grants_loop = GrantsLoop(
        api,
        settings.grants,
        cache,
        mind_cache,
        may_write=may_write,
        metrics=metrics,
        clock=clock,
        kernel=kernels.grants,
        pod_port=settings.pods.port,
    )
    # Each node's engine and lane pods, told to its agent (which may not list pods itself).
    placed = PlacedPods(api, cache, kernels.placed, may_write=may_write, clock=clock)
    lanes = LaneLoop(api, settings, cache, clock, engine_labels, may_write=may_write)
    return [engines, grants_loop, placed, lanes]


class Reconciling(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...
