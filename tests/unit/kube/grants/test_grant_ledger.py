"""The grant ledger as the API server holds it (`kube.ledger.grant_ledger`): entries the gateway
reads, the pool from the plan and the launch, drains, releases named by their reclaim, and
projections. Each step's log lines are judged by `continuum check-log`, which shares nothing with
it."""

from __future__ import annotations

from typing import Any

from continuum_operator import checklog
from continuum_operator.core.grants import EnginePhase, GrantReason, PriorityPolicy
from continuum_operator.engine.admission import table_from_ledger
from continuum_operator.kube.grants import mind_status
from continuum_operator.kube.ledger import grant_ledger, routing
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.mind import GrantState

NS = "minds"
POLICY = PriorityPolicy(grace_seconds=30.0)


def engine(
    slots: int = 2, tokens: int = 4096, args: tuple[str, ...] = ("-np", "2"), ready: bool = True
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": "coder", "resourceVersion": "1"},
        "spec": {"contextTokensPerMind": tokens},
        "status": {
            "plan": {
                "node": "n1",
                "engineArgs": list(args),
                "mindsGrantable": slots,
                "contextTokensPerMind": tokens,
                "schedulable": True,
            },
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def mind(name: str, cls: str = "", tokens: int = 1024, created: int = 0) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": name,
            "creationTimestamp": f"2026-12-03T06:00:{created:02d}Z",
        },
        "spec": {"engine": "coder", "contextTokens": tokens, **({"className": cls} if cls else {})},
    }


CLASSES = [
    {"metadata": {"name": "low"}, "spec": {"priority": 0, "protectionWindowSeconds": 0}},
    {"metadata": {"name": "high"}, "spec": {"priority": 10, "protectionWindowSeconds": 0}},
]


def demands(*minds: dict[str, Any]) -> dict[str, Any]:
    classes, default = routing.classes_of(CLASSES)
    return routing.demands_of(minds, classes, default or "low")


class Run:
    """An engine's status carried from step to step, and the log the operator would write."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.lines: list[dict[str, Any]] = []

    def step(self, now: float, *minds: dict[str, Any]) -> grant_ledger.LedgerStep:
        s = grant_ledger.step(self.body, demands(*minds), now, POLICY)
        status = self.body["status"]
        self.lines += grant_ledger.log_lines(
            now, "minds/coder", status.get(grant_ledger.CAPACITY_FIELD), s
        )
        status["grants"] = [e.wire() for e in s.entries]
        status[grant_ledger.CAPACITY_FIELD] = s.pool.to_status()
        return s

    def entry(self, name: str) -> dict[str, Any] | None:
        for e in self.body["status"]["grants"]:
            if e["mind"] == f"{NS}/{name}":
                return dict(e)
        return None

    def release(self, name: str) -> None:
        """The gateway's report, as `continuum engine` writes it in status.runtime."""
        e = self.entry(name)
        assert e is not None
        runtime = self.body["status"].setdefault("runtime", {"slotReleases": []})
        runtime["slotReleases"].append(
            {"mind": e["mind"], "slot": e["slot"], "reason": e["reason"], "grantSince": e["since"]}
        )

    def check(self) -> list[checklog.Violation]:
        return checklog.check(self.lines)


def test_minds_are_granted_in_priority_order_up_to_the_slots_and_the_gateway_reads_the_table() -> (
    None
):
    run = Run(engine(slots=2))
    minds = (mind("a", "low", created=1), mind("b", "high", created=2), mind("c", "low", created=3))
    run.step(100.0, *minds)
    assert run.entry("b")["state"] == "Granted"  # type: ignore[index]
    assert run.entry("a")["state"] == "Granted"  # type: ignore[index]
    assert run.entry("c")["state"] == "Queued"  # type: ignore[index]
    assert run.entry("c")["position"] == 1  # type: ignore[index]
    table = table_from_ledger(run.body)
    assert table.slot_tokens == 4096
    assert table.entry(f"{NS}/b").state is GrantState.GRANTED  # type: ignore[union-attr]
    assert {table.entry(f"{NS}/{m}").slot for m in "ab"} == {0, 1}  # type: ignore[union-attr]
    assert run.check() == []


def test_entries_read_back_into_the_same_ledger() -> None:
    run = Run(engine(slots=1))
    s = run.step(100.0, mind("a", "low"), mind("b", "high", created=5))
    assert (
        grant_ledger.read_grants(grant_ledger.read_entries(run.body["status"]["grants"]))
        == s.grants
    )


def test_a_preemption_goes_reclaiming_released_queued_once_the_gateway_reports_that_reclaim() -> (
    None
):
    run = Run(engine(slots=1))
    run.step(100.0, mind("low1", "low"))
    run.step(101.0, mind("low1", "low"), mind("vip", "high", created=9))
    low = run.entry("low1")
    assert low is not None and (low["state"], low["reason"], low["by"]) == (
        "Reclaiming",
        "Preempted",
        f"{NS}/vip",
    )
    assert low["deadline"] == 131.0
    # A report of an older reclaim of the same slot frees nothing.
    run.body["status"]["runtime"] = {
        "slotReleases": [{"mind": f"{NS}/low1", "slot": 0, "grantSince": "long ago"}]
    }
    run.step(102.0, mind("low1", "low"), mind("vip", "high", created=9))
    assert run.entry("low1")["state"] == "Reclaiming"  # type: ignore[index]
    run.release("low1")
    s = run.step(103.0, mind("low1", "low"), mind("vip", "high", created=9))
    moves = [(t.mind, t.to_state, t.reason) for t in s.transitions()]
    assert moves == [
        (f"{NS}/low1", GrantState.RELEASED, GrantReason.SLOT_RELEASED),
        (f"{NS}/low1", GrantState.QUEUED, GrantReason.REQUEUED),
        (f"{NS}/vip", GrantState.GRANTED, GrantReason.SLOT_FREE),
        (f"{NS}/low1", GrantState.QUEUED, GrantReason.POOL_FULL),
    ]
    assert run.check() == []


def test_a_new_launch_drains_the_old_slots_and_the_lowest_beyond_the_new_size_is_shrunk() -> None:
    run = Run(engine(slots=3, args=("-np", "3")))
    minds = (mind("a", "high", created=1), mind("b", "low", created=2), mind("c", "low", created=3))
    run.step(100.0, *minds)
    # Part 1 relaunched it with two slots; its pod is ready again before the ledger moved.
    run.body["status"]["plan"].update(mindsGrantable=2, engineArgs=["-np", "2"])
    s = run.step(101.0, *minds)
    assert s.pool.capacity.phase is EnginePhase.DRAINING
    assert (s.pool.capacity.slots, s.pool.capacity.target_slots) == (3, 2)
    reasons = {e["mind"]: (e["state"], e["reason"]) for e in run.body["status"]["grants"]}
    assert reasons[f"{NS}/c"] == ("Reclaiming", "EngineShrunk")
    assert reasons[f"{NS}/a"] == ("Reclaiming", "EngineRelaunching")
    for m in "abc":
        run.release(m)
    s = run.step(102.0, *minds)
    assert s.pool.capacity.phase is EnginePhase.SERVING and s.pool.capacity.slots == 2
    states = {e["mind"]: e["state"] for e in run.body["status"]["grants"]}
    assert states == {f"{NS}/a": "Granted", f"{NS}/b": "Granted", f"{NS}/c": "Queued"}
    assert run.check() == []


def test_an_engine_not_ready_grants_nobody_and_queued_minds_wait_for_its_first_start() -> None:
    run = Run(engine(ready=False))
    s = run.step(100.0, mind("a"))
    assert s.pool.capacity.phase is EnginePhase.STARTING  # it never served: not a relaunch
    assert run.entry("a")["state"] == "Queued"  # type: ignore[index]
    assert run.entry("a")["reason"] == "EngineStarting"  # type: ignore[index]


def test_a_mind_asking_more_than_a_slot_is_refused_and_told_why() -> None:
    run = Run(engine(tokens=4096))
    run.step(100.0, mind("big", tokens=8192))
    e = run.entry("big")
    assert e is not None and (e["state"], e["reason"], e["askedTokens"]) == (
        "Released",
        "ContextTooLarge",
        8192,
    )
    projected = mind_status.projection(GrantEntry.model_validate(e), "minds/coder", 4096, 8192)
    grant, conds = projected.grant, projected.conditions
    assert grant is not None and grant.state == "Refused"  # never granted: not "Released"
    ok, reason, message = conds[mind_status.MindConditionType.CONTEXT_TOO_LARGE]
    assert ok and reason == "ContextTooLarge" and "8192" in message and "4096" in message
    table = table_from_ledger(run.body)
    assert table.entry(f"{NS}/big").asked_tokens == 8192  # type: ignore[union-attr]


def test_a_deleted_mind_is_reclaimed_and_leaves_the_ledger_once_released() -> None:
    run = Run(engine(slots=1))
    run.step(100.0, mind("a"))
    run.step(101.0)  # she was deleted
    assert run.entry("a")["reason"] == "MindDeleted"  # type: ignore[index]
    run.release("a")
    run.step(102.0)
    assert run.entry("a") is None
    assert run.check() == []


def test_a_mind_the_gateway_reports_parked_idle_gives_her_slot_to_the_mind_waiting() -> None:
    run = Run(engine(slots=1))
    minds = (mind("ann", "low", created=1), mind("bob", "low", created=2))
    run.step(100.0, *minds)
    run.step(101.0, *minds)
    assert run.entry("ann")["state"] == "Granted"  # type: ignore[index]
    # The gateway parked Ann at her ask, and says so in its park store's status.
    park = {"budgetBytes": 1, "parkedBytes": 0, "parkedContexts": 0, "minds": [],
            "idle": [f"{NS}/ann"]}  # fmt: skip
    run.body["status"]["runtime"] = {"slotReleases": [], "park": park}
    run.step(102.0, *minds)
    ann = run.entry("ann")
    assert ann is not None and (ann["state"], ann["reason"], ann["by"]) == (
        "Reclaiming",
        "Parked",
        f"{NS}/bob",
    )
    run.release("ann")
    run.step(103.0, *minds)
    assert run.entry("bob")["state"] == "Granted"  # type: ignore[index]
    assert run.entry("ann")["state"] == "Queued"  # type: ignore[index]
    assert run.check() == []
