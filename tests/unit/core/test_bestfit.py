"""Placement by best fit: full offload first, then minds, then the tightest fit; stale boards,
selectors, nodes backing off and nodes without room each get their own verdict."""

from __future__ import annotations

from continuum_operator.core.bestfit import NODE_POOL_LABEL, Exclusion, NodeView, choose
from continuum_operator.core.pools import ConsumerKind, Lease
from continuum_operator.model.engine import Engine
from tests.support.builders import GiB, board, board_body, engine, engine_body


def gpu(name: str, device_gib: int, used_gib: int = 0) -> NodeView:
    body = board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 0},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB,
             "usedBytes": used_gib * GiB},
        ],
        name=name,
    )  # fmt: skip
    return NodeView(board(body), fresh=True)


def eng(**spec: object) -> Engine:
    return engine(engine_body(**spec))


def pick(nodes: list[NodeView], e: Engine, leases: list[Lease] | None = None) -> str | None:
    assert e.spec.model.facts is not None
    d = choose(nodes, e.spec, e.spec.model.facts, leases or [])
    return d.chosen.node if d.chosen else None


def test_the_tightest_node_that_takes_everything_wins() -> None:
    assert pick([gpu("h200", 141), gpu("l40", 48), gpu("a100", 80)], eng()) == "l40"


def test_a_node_that_fits_every_layer_beats_a_tighter_one_that_does_not() -> None:
    assert pick([gpu("small", 6), gpu("big", 80)], eng(minds={"min": 1, "max": 1})) == "big"


def test_more_minds_beat_a_tighter_fit() -> None:
    e = eng(minds={"min": 1, "max": 8})
    assert pick([gpu("fits-two", 12), gpu("fits-all", 48)], e) == "fits-all"


def test_others_leases_count_against_a_node() -> None:
    lease = Lease("Engine/x/y", ConsumerKind.ENGINE, "l40", "device/0", 40 * GiB)
    assert pick([gpu("l40", 48), gpu("a100", 80)], eng(), [lease]) == "a100"


def test_a_stale_board_a_mismatched_selector_and_a_backoff_are_each_reported() -> None:
    e = eng(placement={"nodeSelector": {"zone": "a"}})
    assert e.spec.model.facts is not None
    nodes = [
        NodeView(gpu("stale", 80).board, fresh=False, labels={"zone": "a"}),
        NodeView(gpu("elsewhere", 80).board, fresh=True, labels={"zone": "b"}),
        NodeView(gpu("retrying", 80).board, fresh=True, labels={"zone": "a"}, backing_off=True),
        NodeView(gpu("ghost", 80).board, fresh=True, labels={"zone": "a"}, node_exists=False),
    ]
    d = choose(nodes, e.spec, e.spec.model.facts, [])
    assert d.chosen is None
    assert {v.node: v.excluded for v in d.verdicts} == {
        "stale": Exclusion.BOARD_STALE,
        "elsewhere": Exclusion.SELECTOR_MISMATCH,
        "retrying": Exclusion.BACKING_OFF,
        "ghost": Exclusion.NO_NODE,
    }
    messages = {v.node: v.message for v in d.verdicts}
    assert messages["stale"] == "board is stale (its node Lease expired)"


def test_a_board_whose_node_is_gone_is_reported_as_such_not_as_a_selector_mismatch() -> None:
    e = eng(placement={"nodeSelector": {"zone": "a"}})
    assert e.spec.model.facts is not None
    # The Node deleted: no labels are known, and the selector must not be blamed for it.
    ghost = NodeView(gpu("ghost", 80).board, fresh=True, labels={}, node_exists=False)
    d = choose([ghost], e.spec, e.spec.model.facts, [])
    assert [(v.node, v.excluded) for v in d.verdicts] == [("ghost", Exclusion.NO_NODE)]
    assert "no Node object" in d.verdicts[0].message


def test_a_node_pool_is_matched_by_its_label() -> None:
    e = eng(placement={"nodePool": "inference"})
    nodes = [
        NodeView(gpu("a", 80).board, fresh=True, labels={NODE_POOL_LABEL: "batch"}),
        NodeView(gpu("b", 80).board, fresh=True, labels={NODE_POOL_LABEL: "inference"}),
    ]
    assert pick(nodes, e) == "b"


def test_a_node_without_room_says_what_the_plan_needs() -> None:
    e = eng(minds={"min": 64, "max": 64}, contextTokensPerMind=131072)
    assert e.spec.model.facts is not None
    d = choose([gpu("small", 8)], e.spec, e.spec.model.facts, [])
    assert d.chosen is None
    assert d.verdicts[0].excluded is Exclusion.UNSCHEDULABLE
    assert "need" in d.verdicts[0].message


def test_the_choice_does_not_depend_on_the_order_nodes_are_seen() -> None:
    nodes = [gpu(f"n{i}", 40 + 8 * (i % 3)) for i in range(9)]
    e = eng()
    assert pick(nodes, e) == pick(list(reversed(nodes)), e) == "n0"
