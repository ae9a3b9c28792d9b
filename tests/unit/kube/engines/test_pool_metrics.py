"""Per node and pool gauges (`kube.engines.pool_metrics`): capacity and measured use from the board,
leases by consumer kind from the engines' and lanes' placements, floors, available bytes as
capacity - max(leased, used), the node's memory mode; series of pools that are gone are dropped."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from continuum_operator.kube.engines.pool_metrics import PoolMetrics, pool_rows
from continuum_operator.kube.state.cache import Cache
from tests.support import builders

GiB = 2**30


def _cache() -> Cache:
    cache = Cache()
    pools = [
        {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 40 * GiB},
        {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 10 * GiB},
    ]
    cache.observe_board(builders.board_body("discrete", pools, name="n1"), deleted=False)
    cache.observe_board(
        builders.board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}], name="n2"),
        deleted=False,
    )
    engine: dict[str, Any] = builders.engine_body()
    engine["status"] = {
        "placement": {
            "node": "n1",
            "gpus": [0],
            "pools": [
                {"pool": "device/0", "bytes": 30 * GiB},
                {"pool": "host", "bytes": 2 * GiB},
            ],
        }
    }
    cache.observe_engine(engine, deleted=False)
    lane = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "EmbedLane",
        "metadata": {"name": "notes", "namespace": "ns"},
        "spec": {},
        "status": {
            "placement": {
                "node": "n1",
                "verdict": "Fits",
                "residence": "device",
                "pools": [{"pool": "device/0", "bytes": 1 * GiB, "floorBytes": 3 * GiB // 2}],
            }
        },
    }
    cache.observe_lane(lane, deleted=False)
    return cache


def test_rows_carry_the_boards_figures_and_the_leases_held_in_each_pool() -> None:
    rows, modes = pool_rows(_cache().snapshot())
    by = {(r.node, r.pool): r for r in rows}
    device = by[("n1", "device/0")]
    assert device.capacity_bytes == 80 * GiB
    assert device.used_bytes == 10 * GiB
    assert dict(device.leased_bytes) == {"Engine": 30 * GiB, "EmbedLane": 3 * GiB // 2}
    assert device.floor_bytes == 3 * GiB // 2
    # capacity - max(leased 31.5 GiB, used 10 GiB)
    assert device.available_bytes == 80 * GiB - (30 * GiB + 3 * GiB // 2)
    host = by[("n1", "host")]
    assert host.available_bytes == 256 * GiB - 40 * GiB  # measured use above the 2 GiB leased
    unsampled = by[("n2", "host")]
    assert unsampled.used_bytes is None and unsampled.available_bytes is None
    assert {k: str(v) for k, v in modes.items()} == {"n1": "discrete", "n2": "unknown"}


def test_the_gauges_show_the_rows_and_drop_the_series_of_a_deleted_board() -> None:
    cache = _cache()
    metrics = PoolMetrics(CollectorRegistry())
    metrics.record(cache.snapshot())
    r = metrics.registry
    labels = {"node": "n1", "pool": "device/0"}
    assert r.get_sample_value("continuum_pool_capacity_bytes", labels) == 80 * GiB
    assert r.get_sample_value("continuum_pool_used_bytes", labels) == 10 * GiB
    assert (
        r.get_sample_value("continuum_pool_leased_bytes", {**labels, "consumer_kind": "Engine"})
        == 30 * GiB
    )
    assert r.get_sample_value("continuum_pool_floor_bytes", labels) == 3 * GiB // 2
    assert r.get_sample_value("continuum_node_memory_mode", {"node": "n2", "mode": "unknown"}) == 1
    assert r.get_sample_value("continuum_node_memory_mode", {"node": "n2", "mode": "discrete"}) == 0
    # An unsampled pool has no used or available series, rather than a made-up 0.
    assert r.get_sample_value("continuum_pool_used_bytes", {"node": "n2", "pool": "host"}) is None
    assert (
        r.get_sample_value("continuum_pool_available_bytes", {"node": "n2", "pool": "host"}) is None
    )

    cache.observe_board({"metadata": {"name": "n2"}}, deleted=True)
    metrics.record(cache.snapshot())
    text = generate_latest(r).decode()
    assert 'node="n2"' not in text
    assert 'node="n1"' in text


def test_a_lease_moved_between_passes_updates_only_the_changed_series() -> None:
    # Gauges are set only when their value changed: a value that changed must still show.
    cache = _cache()
    metrics = PoolMetrics(CollectorRegistry())
    metrics.record(cache.snapshot())
    engine: dict[str, Any] = builders.engine_body()
    engine["metadata"]["resourceVersion"] = "99"
    engine["status"] = {
        "placement": {"node": "n1", "gpus": [0], "pools": [{"pool": "device/0", "bytes": 50 * GiB}]}
    }
    cache.observe_engine(engine, deleted=False)
    metrics.record(cache.snapshot())
    r = metrics.registry
    device = {"node": "n1", "pool": "device/0", "consumer_kind": "Engine"}
    host = {"node": "n1", "pool": "host", "consumer_kind": "Engine"}
    assert r.get_sample_value("continuum_pool_leased_bytes", device) == 50 * GiB
    assert r.get_sample_value("continuum_pool_leased_bytes", host) == 0
    # Another node's board alone: its figures, the engine's leases on n1 unchanged.
    cache.observe_board({"metadata": {"name": "n2"}}, deleted=True)
    metrics.record(cache.snapshot())
    assert r.get_sample_value("continuum_pool_leased_bytes", device) == 50 * GiB
    assert r.get_sample_value("continuum_pool_capacity_bytes", {"node": "n1", "pool": "host"}) == (
        256 * GiB
    )
