"""An Engine no node takes says why in counts and the closest node, as kube-scheduler does, in a
message bounded whatever the fleet (`core.unfit`); the closest node's shortfall means what it
says (that many bytes more and the plan fits)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from continuum_operator.core.bestfit import NodeView, choose
from continuum_operator.core.plan import plan
from continuum_operator.core.unfit import MAX_MESSAGE_BYTES, summarise
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import BoardEntry, NodeEntry, Snapshot
from continuum_operator.kube.state.lease_renewal import LeaseEntry
from tests.support.builders import GiB, board, board_body, engine, engine_body
from tests.support.reconcile import NOW, SETTINGS, after, engine_obj

HUGE: dict[str, Any] = {"minds": {"min": 64, "max": 64}, "contextTokensPerMind": 131072}


def gpu_board(name: str, device_gib: int, host_gib: int = 256) -> dict[str, Any]:
    return board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": host_gib * GiB, "usedBytes": 4 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB, "usedBytes": 0},
        ],
        name=name,
    )


def fleet() -> Snapshot:
    """1,000 nodes: 640 too small (gpu-0417 the largest host), 300 stale, 60 of another zone."""
    boards, nodes, leases = {}, {}, {}
    for i in range(1000):
        name = f"gpu-{i:04d}"
        host = 768 if i == 417 else 256 + (i % 7) * 32
        b = board(gpu_board(name, 24 + i % 5 * 8, host))
        boards[name] = BoardEntry(b, resource_version=f"rv-{i}")
        zone = "b" if i >= 940 else "a"
        nodes[name] = NodeEntry({"zone": zone}, 1)
        stale = 640 <= i < 940
        leases[name] = LeaseEntry(
            renew_time=NOW - (7200 if stale else 1), duration_seconds=3600, resource_version="1"
        )
    return Snapshot(boards=boards, leases=leases, nodes=nodes, engines={}, deployments={})


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


def test_an_engine_unschedulable_on_1000_boards_says_so_in_under_1_kib_naming_the_closest() -> None:
    e = engine_obj(placement={"nodeSelector": {"zone": "a"}}, **HUGE)
    w = reconcile(e, fleet(), Memory(), NOW, SETTINGS)
    body = after(e, w)
    c = condition(body, "Unschedulable")
    msg = c["message"]
    assert c["status"] == "True" and c["reason"] == "InsufficientMemory"
    assert len(msg.encode()) < 1024
    assert msg.startswith("no node has room: 0/1000 nodes fit: 640 with too little memory ")
    assert "(closest: gpu-0417, " in msg and " MiB short)" in msg
    assert (
        "300 with a stale board, its node Lease expired (gpu-0640, gpu-0641, gpu-0642, ...)" in msg
    )
    assert "60 not matching spec.placement.nodeSelector (gpu-0940, " in msg
    # The closest node's own reason, in full: what it lacks and what to change.
    assert "Closest gpu-0417: 64 mind(s) of 131072 tokens" in msg and "Lower spec.minds.min" in msg
    # The Ready condition and the Warning event say the same, not the node list.
    assert condition(body, "Ready")["message"] == msg
    assert any(ev.type == "Warning" and ev.message == msg for ev in w.events)


def test_the_closest_node_is_the_one_with_the_smallest_shortfall_and_the_figure_is_its_own() -> (
    None
):
    e = engine(engine_body(**HUGE))
    assert e.spec.model.facts is not None
    views = [NodeView(board(gpu_board(n, 24, h)), fresh=True) for n, h in
             (("small", 256), ("middling", 512), ("largest", 900))]  # fmt: skip
    why = summarise(choose(views, e.spec, e.spec.model.facts, []))
    assert why.closest is not None and why.closest.node == "largest"
    alone = plan(views[2].board, e.spec, e.spec.model.facts)
    assert alone.shortfall_bytes is not None and alone.shortfall_bytes > 0
    shown = -(-alone.shortfall_bytes // 2**20)
    assert f"(closest: largest, {shown:,} MiB short)" in why.message


def test_a_shortfall_is_the_bytes_that_would_make_the_plan_fit() -> None:
    e = engine(engine_body(offload="all", minds={"min": 4, "max": 4}))
    facts = e.spec.model.facts
    assert facts is not None
    short = plan(board(gpu_board("n", 8)), e.spec, facts).shortfall_bytes
    assert short is not None and short > 0

    def with_device(extra: int) -> bool:
        b = board(gpu_board("n", 8))
        pool = b.pools["device/0"]
        grown = replace(b, pools={**b.pools, "device/0": replace(
            pool, capacity_bytes=pool.capacity_bytes + extra)})  # fmt: skip
        p = plan(grown, e.spec, facts)
        assert p.schedulable or p.shortfall_bytes == short - extra
        return p.schedulable

    assert with_device(short) and not with_device(short - 1)


def test_very_long_node_names_still_keep_the_message_bounded() -> None:
    e = engine(engine_body(**HUGE))
    assert e.spec.model.facts is not None
    views = [
        NodeView(board(gpu_board(f"{'n' * 240}-{i:03d}", 24)), fresh=fresh, backing_off=off)
        for i in range(300)
        for fresh, off in ((i % 3 != 0, i % 3 == 1),)
    ]
    why = summarise(choose(views, e.spec, e.spec.model.facts, []))
    assert len(why.message.encode()) <= MAX_MESSAGE_BYTES
    assert why.closest is not None and why.closest.node in why.message
    assert sum(len(g.nodes) for g in why.groups) == 300


def test_a_fleet_of_no_boards_says_the_agent_is_missing() -> None:
    e = engine(engine_body())
    assert e.spec.model.facts is not None
    why = summarise(choose([], e.spec, e.spec.model.facts, []))
    assert why.reason == "NoBoards" and "node agent" in why.message
