"""`continuum_node_board_fresh{node}`: the operator's view of each board's freshness, exported
for the chart's ContinuumBoardStale alert (docs/metrics.md). Fresh means the node's agent Lease
was renewed within its duration, exactly as placement judges it (`reconcile.is_fresh`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from continuum_operator.core.heartbeat import LEASE_NAMESPACE, lease_name
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.state.cache import Cache
from tests.support import builders

NOW = 1_800_000_000.0
GiB = 2**30


def _cache() -> Cache:
    return Cache(clock=lambda: NOW)


def _loop(cache: Cache, metrics: OperatorMetrics, clock: list[float]) -> Loop:
    fake: Any = object()  # record_boards makes no API call
    api: AsyncKubeApi = fake
    cache.clock = lambda: clock[0]  # one clock for the cache and the loop (`kube.process.run`)
    return Loop(api, OperatorSettings(), cache, clock=lambda: clock[0], metrics=metrics)


def _board(cache: Cache, node: str) -> None:
    pools = [{"kind": "host", "name": "host", "capacityBytes": 64 * GiB, "usedBytes": 8 * GiB}]
    cache.observe_board(builders.board_body("discrete", pools, name=node), deleted=False)


def _lease(cache: Cache, node: str, renewed: float, seconds: int = 40) -> None:
    cache.observe_lease(
        {
            "metadata": {"name": lease_name(node), "namespace": LEASE_NAMESPACE},
            "spec": {"renewTime": format_seconds(renewed), "leaseDurationSeconds": seconds},
        },
        deleted=False,
    )


def _value(metrics: OperatorMetrics, node: str) -> float | None:
    return metrics.registry.get_sample_value("continuum_node_board_fresh", {"node": node})


def test_a_board_whose_lease_was_renewed_in_time_is_fresh_and_one_past_it_is_stale() -> None:
    cache, metrics, clock = _cache(), OperatorMetrics(), [NOW]
    for node in ("n-fresh", "n-stale", "n-nolease"):
        _board(cache, node)
    _lease(cache, "n-fresh", NOW - 10)
    _lease(cache, "n-stale", NOW - 41)
    _loop(cache, metrics, clock).record_boards()
    assert _value(metrics, "n-fresh") == 1
    assert _value(metrics, "n-stale") == 0
    assert _value(metrics, "n-nolease") == 0  # never renewed: never trusted


def test_a_board_goes_stale_as_time_passes_and_fresh_again_when_renewed() -> None:
    cache, metrics, clock = _cache(), OperatorMetrics(), [NOW]
    _board(cache, "n1")
    _lease(cache, "n1", NOW)
    loop = _loop(cache, metrics, clock)
    loop.record_boards()
    assert _value(metrics, "n1") == 1
    clock[0] = NOW + 41
    loop.record_boards()
    assert _value(metrics, "n1") == 0
    _lease(cache, "n1", NOW + 41)
    loop.record_boards()
    assert _value(metrics, "n1") == 1


def test_a_deleted_board_leaves_the_metric() -> None:
    cache, metrics, clock = _cache(), OperatorMetrics(), [NOW]
    _board(cache, "n1")
    _board(cache, "n2")
    loop = _loop(cache, metrics, clock)
    loop.record_boards()
    cache.observe_board({"metadata": {"name": "n2"}}, deleted=True)
    loop.record_boards()
    text = generate_latest(metrics.registry).decode()
    assert 'continuum_node_board_fresh{node="n1"} 0.0' in text
    assert 'node="n2"' not in text
