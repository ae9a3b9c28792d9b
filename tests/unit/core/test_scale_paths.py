"""What the operator does per event stays small: leases indexed once, heartbeats that change no
decision do not wake the loop, requests are counted by resource (bench/scale.py's figures)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from continuum_operator.core.bestfit import NodeView, choose, leftover_bytes, rank
from continuum_operator.core.heartbeat import agent_lease_metadata
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.rfc3339 import parse as parse_rfc3339
from continuum_operator.kube.client.api import resource_of
from continuum_operator.kube.state.cache import Cache, EngineKey
from continuum_operator.kube.state.occupancy import other_leases, other_leases_and_assumed
from tests.support.builders import board, board_body, engine_body
from tests.support.builders import engine as parsed_engine

GiB = 2**30


def engine(name: str, rv: int, node: str | None, *, assumed: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if node is not None:
        status["placement"] = {
            "node": node,
            "assumed": assumed,
            "pools": [{"pool": "device/0", "bytes": 3 * GiB}, {"pool": "host", "bytes": GiB}],
        }
    return {
        "metadata": {"namespace": "ns", "name": name, "resourceVersion": str(rv)},
        "spec": {},
        "status": status,
    }


def lease(node: str, rv: int, renew: str, duration: int = 40) -> dict[str, Any]:
    return {
        "metadata": {**agent_lease_metadata(node), "resourceVersion": str(rv)},
        "spec": {"renewTime": renew, "leaseDurationSeconds": duration},
    }


def node(name: str, labels: dict[str, str], heartbeat: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {
            "allocatable": {"nvidia.com/gpu": "1"},
            "conditions": [{"type": "Ready", "lastHeartbeatTime": heartbeat}],
        },
    }


def test_the_cache_index_gives_the_leases_a_parse_of_every_engine_gives() -> None:
    cache = Cache()
    cache.observe_engine(engine("a", 1, "n1"), deleted=False)
    cache.observe_engine(engine("b", 1, "n1", assumed=False), deleted=False)
    cache.observe_engine(engine("c", 1, "n2"), deleted=False)
    cache.observe_engine(engine("d", 1, None), deleted=False)
    cache.observe_engine(engine("e", 1, "n2"), deleted=False)
    cache.observe_engine(engine("c", 2, "n3", assumed=False), deleted=False)  # moved
    cache.observe_engine(engine("e", 2, "n2"), deleted=True)  # gone
    cache.observe_engine(engine("a", 0, "n9"), deleted=False)  # older than known: ignored
    bad = engine("f", 1, "n1")
    bad["status"]["placement"]["pools"][0]["bytes"] = -1  # does not validate: no lease
    cache.observe_engine(bad, deleted=False)
    indexed = cache.snapshot()
    parsed = replace(indexed, engine_leases=None, engines_on=None)
    assert indexed.engines_on == {
        "n1": frozenset({("ns", "a"), ("ns", "b")}),
        "n3": frozenset({("ns", "c")}),
    }
    me: EngineKey
    for me in [("ns", x) for x in "abcdf"]:
        for assumed_only in (False, True):
            for on in (None, "n1", "n2", "n3"):
                got = other_leases(indexed, me, assumed_only=assumed_only, node=on)
                want = other_leases(parsed, me, assumed_only=assumed_only, node=on)
                assert Counter(got) == Counter(want), (me, assumed_only, on)
        for snap in (indexed, parsed):  # both at once, in one walk (the placement reads both)
            assert other_leases_and_assumed(snap, me) == (
                other_leases(snap, me),
                other_leases(snap, me, assumed_only=True),
            )
    everyone = other_leases(indexed, ("", ""))
    assert {(x.consumer.split("/")[-1], x.node) for x in everyone} == {
        ("a", "n1"),
        ("b", "n1"),
        ("c", "n3"),
    }


T0 = parse_rfc3339("2026-01-01T00:00:00.000000Z") or 0.0


def test_a_lease_renewed_before_it_expired_does_not_wake_the_loop() -> None:
    now = [T0]
    cache = Cache(clock=lambda: now[0])
    cache.observe_lease(lease("n1", 1, "2026-01-01T00:00:00.000000Z"), deleted=False)
    assert cache.changed.is_set()  # a node seen for the first time
    cache.changed.clear()
    now[0] = T0 + 30
    cache.observe_lease(lease("n1", 2, "2026-01-01T00:00:30.000000Z"), deleted=False)
    assert not cache.changed.is_set()
    assert cache.leases["n1"].resource_version == "2"  # still recorded, for the next pass


@pytest.mark.parametrize(
    ("renew", "duration"),
    [
        ("2026-01-01T00:01:00.000000Z", 40),  # after it expired: the board was stale
        ("2026-01-01T00:00:30.000000Z", 10),  # a shorter duration
        ("2025-12-31T23:59:00.000000Z", 40),  # back in time
    ],
)
def test_a_lease_renewed_late_or_changed_wakes_the_loop(renew: str, duration: int) -> None:
    now = [T0]
    cache = Cache(clock=lambda: now[0])
    cache.observe_lease(lease("n1", 1, "2026-01-01T00:00:00.000000Z"), deleted=False)
    cache.changed.clear()
    now[0] = max(T0, parse_rfc3339(renew) or 0.0)
    cache.observe_lease(lease("n1", 2, renew, duration), deleted=False)
    assert cache.changed.is_set()


def test_a_renewal_seen_after_the_board_went_stale_on_our_clock_wakes_the_loop() -> None:
    # The agent's clock says it renewed 30 s after the last (in time), but we saw it 41 s after
    # the last: the board was stale meanwhile, whatever the agent's clock says.
    now = [T0]
    cache = Cache(clock=lambda: now[0])
    cache.observe_lease(lease("n1", 1, "2026-01-01T00:00:00.000000Z"), deleted=False)
    cache.changed.clear()
    now[0] = T0 + 41
    cache.observe_lease(lease("n1", 2, "2026-01-01T00:00:30.000000Z"), deleted=False)
    assert cache.changed.is_set()


def test_a_node_heartbeat_does_not_wake_the_loop_but_a_label_change_does() -> None:
    cache = Cache()
    cache.observe_node(node("n1", {"pool": "a"}, "t1"), deleted=False)
    cache.changed.clear()
    cache.observe_node(node("n1", {"pool": "a"}, "t2"), deleted=False)
    assert not cache.changed.is_set()
    cache.observe_node(node("n1", {"pool": "b"}, "t3"), deleted=False)
    assert cache.changed.is_set()
    assert cache.nodes["n1"].labels == {"pool": "b"}


@pytest.mark.parametrize(
    ("path", "resource"),
    [
        ("/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status", "engines/status"),
        ("/apis/continuum.dev/v1alpha1/namespaces/ns/minds/m", "minds"),
        ("/apis/continuum.dev/v1alpha1/minds", "minds"),
        ("/api/v1/namespaces/ns/pods/p/log", "pods/log"),
        ("/api/v1/namespaces/ns/events", "events"),
        ("/api/v1/namespaces/ns", "namespaces"),
        ("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/x", "leases"),
        ("/apis/scheduling.k8s.io/v1/priorityclasses/p?fieldManager=x", "priorityclasses"),
    ],
)
def test_a_request_is_counted_by_its_resource(path: str, resource: str) -> None:
    assert resource_of(path) == resource


def test_nodes_alike_are_planned_once_and_each_gets_the_plan_it_would_alone() -> None:
    def discrete(name: str, device_gib: int, used_gib: int) -> Board:
        pools = [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 8 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB,
             "usedBytes": used_gib * GiB},
        ]  # fmt: skip
        return board(board_body("discrete", pools, name=name))

    boards = [discrete(f"n{i}", 24 if i % 2 else 80, 1) for i in range(8)]
    boards += [discrete("busy", 24, 20), discrete("tiny", 4, 1)]
    held = [
        Lease("Engine/ns/x", ConsumerKind.ENGINE, "n2", "device/0", 10 * GiB),
        Lease("Engine/ns/y", ConsumerKind.ENGINE, "n3", "device/0", 30 * GiB),
        Lease("Engine/ns/z", ConsumerKind.ENGINE, "n4", "device/0", 10 * GiB),  # like n2
    ]
    spec = parsed_engine(engine_body()).spec
    assert spec.model.facts is not None
    views = [NodeView(b, True, {}, node_exists=True, backing_off=False) for b in boards]
    decision = choose(views, spec, spec.model.facts, held)
    ranked = []
    for b, verdict in zip(sorted(boards, key=lambda b: b.node), decision.verdicts, strict=True):
        ledger = BoardLeases.of(b, held)
        alone = plan(b, spec, spec.model.facts, ledger)
        assert verdict.node == b.node
        assert verdict.plan == alone
        if alone.schedulable:
            ranked.append((rank(alone, leftover_bytes(alone, ledger)), alone))
    assert decision.chosen == min(ranked, key=lambda r: r[0])[1]
    assert decision.chosen.node not in ("busy", "tiny")


def test_the_decide_only_bench_decides_fewer_engines_at_rest_than_a_full_pass() -> None:
    # bench/scale.py --decide-only at a tiny size: its figures compare the dirty sets' passes
    # with a full pass, so if the dirty sets stopped working the bench must say so here.
    from bench.decide import run

    lines: list[str] = []
    got = run(nodes=4, engines=6, minds=12, out=lines.append)
    assert got.engines_placed == 6 and got.minds_granted == 12
    plan = {k.split(" (")[0]: f for k, f in got.plan.items()}
    assert plan["placing every engine"].decided == 6
    full = plan["the full pass"].decided
    assert full == 6
    assert plan["a pass at rest"].decided < full and plan["a pass at rest"].written == 0
    assert plan["a pass after one NodeBoard changed"].decided < full
    assert plan["a pass after one Engine's spec changed"].decided < full
    grants = {k.split(" (")[0]: f for k, f in got.grants.items()}
    assert grants["the first pass, granting every mind"].decided == 6
    assert grants["the full pass"].decided == 6
    assert grants["a pass after one Mind created"].decided == 1
    assert grants["a pass with nothing changed"].decided == 0
    assert len(lines) == len(got.plan) + len(got.grants) + 4  # headers and notes printed
