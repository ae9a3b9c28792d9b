"""Statuses a person reads at a glance (`kubectl get minds`, `kubectl get engine -o yaml`): every
state of a Mind carries a REASON, the pool's phase says whether the engine ever served, the
Engine's journal shows times as RFC 3339, and a board's capacity reads in GiB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from continuum_operator import checklog
from continuum_operator.core.grants import EnginePhase, GrantReason, PriorityPolicy
from continuum_operator.kube.grants import mind_status
from continuum_operator.kube.ledger import grant_ledger, journal, routing
from continuum_operator.kube.ledger.transition_log import TransitionLog
from continuum_operator.model.board import NodeBoard, capacity_text, gib_text
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.mind import Mind
from tests.support.builders import ROOT
from tests.support.grants_world import BASE, World, mind

NS = "team-a"
POLICY = PriorityPolicy(grace_seconds=30.0)


def conditions(ready: tuple[str, str, str], **others: tuple[str, str]) -> list[dict[str, Any]]:
    status, reason, message = ready
    out = [{"type": "Ready", "status": status, "reason": reason, "message": message}]
    out += [{"type": t, "status": s, "reason": r} for t, (s, r) in others.items()]
    return out


def engine(status: dict[str, Any], name: str = "coder") -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": name, "resourceVersion": "10"},
        "spec": {"contextTokensPerMind": 1000},
        "status": status,
    }


UNSCHEDULABLE: dict[str, Any] = {
    "conditions": conditions(
        ("False", "InsufficientMemory", "node a100-01: needs 812 GiB, has 79 GiB"),
        Unschedulable=("True", "InsufficientMemory"),
        Planned=("False", "NotPlaced"),
    )
}
PLACED_NOT_READY: dict[str, Any] = {
    "plan": {"node": "n", "engineArgs": ["-np", "2"], "mindsGrantable": 2,
             "contextTokensPerMind": 1000},
    "conditions": conditions(("False", "PodPending", "the engine pod has not started yet")),
}  # fmt: skip
SERVING: dict[str, Any] = {
    **PLACED_NOT_READY,
    "conditions": conditions(("True", "PodReady", "the engine pod is ready")),
}


def shown(w: World, name: str) -> tuple[str, str, str]:
    """What `kubectl get minds` prints for her: GRANT, REASON, and the message of -o wide."""
    grant = w.status("minds", NS, name).get("grant") or {}
    return grant.get("state", ""), grant.get("reason", ""), grant.get("message", "")


def test_a_mind_of_an_unschedulable_engine_says_so_not_that_it_relaunches(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine(UNSCHEDULABLE))
    w.mind(mind(NS, "ann", "coder"))
    w.loop.pass_once()
    state, reason, message = shown(w, "ann")
    assert (state, reason) == ("Queued", "EngineUnschedulable")
    assert "Engine team-a/coder is not serving: InsufficientMemory: node a100-01" in message
    pool = w.status("grantledgers", NS, "coder")[grant_ledger.CAPACITY_FIELD]
    assert pool["phase"] == "Unschedulable"


def test_an_engine_refused_as_an_invalid_spec_is_unschedulable_for_its_minds() -> None:
    body = engine({"conditions": conditions(("False", "InvalidSpec", "spec.model: ..."),
                                            Planned=("False", "InvalidSpec"))})  # fmt: skip
    assert grant_ledger.capacity_of(body, {}).capacity.phase is EnginePhase.UNSCHEDULABLE


def test_an_engine_never_launched_is_starting_then_serving_then_relaunching(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine(PLACED_NOT_READY))
    w.mind(mind(NS, "ann", "coder"))
    w.loop.pass_once()
    assert w.status("grantledgers", NS, "coder")[grant_ledger.CAPACITY_FIELD]["phase"] == "Starting"
    state, reason, message = shown(w, "ann")
    assert (state, reason) == ("Queued", "EngineStarting")
    assert "PodPending: the engine pod has not started yet" in message

    body = w.api.objects[f"/apis/continuum.dev/v1alpha1/namespaces/{NS}/engines/coder"]
    w.engine({**body, "status": {**body["status"], **SERVING}})
    w.loop.pass_once()
    assert shown(w, "ann")[:2] == ("Granted", "SlotFree")

    # Its pod restarts on the same launch: now it is a relaunch, since it served.
    body = w.api.objects[f"/apis/continuum.dev/v1alpha1/namespaces/{NS}/engines/coder"]
    w.engine({**body, "status": {**body["status"], **PLACED_NOT_READY}})
    w.mind(mind(NS, "bob", "coder", second=2))
    w.loop.pass_once()
    assert (
        w.status("grantledgers", NS, "coder")[grant_ledger.CAPACITY_FIELD]["phase"] == "Relaunching"
    )
    assert shown(w, "bob")[:2] == ("Queued", "EngineRelaunching")


def test_a_mind_parked_on_her_engine_says_her_context_and_its_bytes(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine(SERVING))
    w.mind(mind(NS, "ann", "coder"))
    w.mind(mind(NS, "bob", "coder", second=2))
    w.loop.pass_once()
    assert "parked" not in w.status("minds", NS, "ann")
    # The engine's runtime reports Ann's context in its park store.
    body = w.api.objects[f"/apis/continuum.dev/v1alpha1/namespaces/{NS}/engines/coder"]
    park = {"budgetBytes": 10**9, "parkedBytes": 4096, "parkedContexts": 1,
            "minds": [{"mind": f"{NS}/ann", "tokens": 2000, "bytes": 4096}]}  # fmt: skip
    runtime = {**(body["status"].get("runtime") or {}), "park": park}
    w.engine({**body, "metadata": {**body["metadata"], "resourceVersion": "11"},
              "status": {**body["status"], "runtime": runtime}})  # fmt: skip
    w.loop.pass_once()
    assert w.status("minds", NS, "ann")["parked"] == {"tokens": 2000, "bytes": 4096}
    assert w.status("minds", NS, "bob").get("parked") is None
    assert Mind.model_validate(w.api.objects[f"{BASE}/{NS}/minds/ann"]).status is not None
    # Restored (or dropped): the engine no longer lists her, and nor does her status.
    body = w.api.objects[f"/apis/continuum.dev/v1alpha1/namespaces/{NS}/engines/coder"]
    runtime = {**runtime, "park": {**park, "parkedBytes": 0, "parkedContexts": 0, "minds": []}}
    w.engine({**body, "metadata": {**body["metadata"], "resourceVersion": "12"},
              "status": {**body["status"], "runtime": runtime}})  # fmt: skip
    w.loop.pass_once()
    assert w.status("minds", NS, "ann").get("parked") is None


def test_after_a_drain_the_successor_not_yet_ready_is_a_relaunch_not_a_first_start() -> None:
    body = engine({**SERVING, "plan": {**SERVING["plan"], "engineArgs": ["-np", "1"]}})
    demands = routing.demands_of([mind(NS, "a", "coder")], {}, "")
    s = grant_ledger.step(body, demands, 100.0, POLICY)
    body["status"]["grants"] = [e.wire() for e in s.entries]
    body["status"][grant_ledger.CAPACITY_FIELD] = s.pool.to_status()
    # A new launch while she holds a slot: the pod of the new plan is not ready yet.
    body["status"]["plan"] = {**body["status"]["plan"], "engineArgs": ["-np", "2"]}
    body["status"]["conditions"] = PLACED_NOT_READY["conditions"]
    s = grant_ledger.step(body, demands, 101.0, POLICY)
    assert s.pool.capacity.phase is EnginePhase.DRAINING
    entry = next(e for e in s.entries if e.mind == f"{NS}/a")
    body["status"]["grants"] = [e.wire() for e in s.entries]
    body["status"][grant_ledger.CAPACITY_FIELD] = s.pool.to_status()
    body["status"]["runtime"] = {"slotReleases": [
        {"mind": entry.mind, "slot": entry.slot, "grantSince": entry.since}]}  # fmt: skip
    s = grant_ledger.step(body, demands, 102.0, POLICY)
    assert s.pool.capacity.phase is EnginePhase.RELAUNCHING
    assert [e.reason for e in s.entries] == ["EngineRelaunching"]


def test_a_mind_asking_more_than_a_slot_is_shown_refused_never_released(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine(SERVING))
    w.mind(mind(NS, "big", "coder", contextTokens=4000))
    w.loop.pass_once()
    # The ledger keeps the allocator's table (Released, ContextTooLarge); she reads Refused.
    assert w.ledger(NS, "coder") == {f"{NS}/big": ("Released", "ContextTooLarge")}
    state, reason, message = shown(w, "big")
    assert (state, reason) == ("Refused", "ContextTooLarge")
    assert "asks 4000 tokens but a slot of Engine team-a/coder holds 1000" in message


def test_a_mind_naming_a_missing_engine_shows_it_in_grant_and_reason(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.mind(mind(NS, "ann", "codr"))
    w.loop.pass_once()
    state, reason, message = shown(w, "ann")
    assert (state, reason) == ("Refused", "EngineNotFound")
    assert "Engine team-a/codr does not exist" in message
    assert w.granted(NS, "ann")["reason"] == "EngineNotFound"  # the condition agrees


def test_a_mind_naming_a_missing_class_shows_it_in_grant_and_reason(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine(SERVING))
    w.mind(mind(NS, "ann", "coder", className="gold"))
    w.loop.pass_once()
    assert shown(w, "ann")[:2] == ("Refused", "ClassNotFound")


@given(
    state=st.sampled_from(["Queued", "Granted", "Reclaiming", "Released"]),
    reason=st.sampled_from(list(GrantReason)),
)
def test_every_ledger_entry_projects_to_a_state_a_reason_and_a_message(
    state: str, reason: GrantReason
) -> None:
    entry = {"mind": f"{NS}/a", "state": state, "reason": reason.value, "position": 1,
             "slot": 0, "tokens": 10, "since": "2026-12-03T06:00:00.000000Z"}  # fmt: skip
    projected = mind_status.projection(
        GrantEntry.model_validate(entry), f"{NS}/coder", 1000, 10, engine_note="X: y"
    )
    grant, conds = projected.grant, projected.conditions
    assert grant is not None and grant.state and grant.reason and grant.message
    Mind.model_validate({"metadata": {"name": "a", "namespace": NS},
                         "spec": {"engine": "coder", "contextTokens": 10},
                         "status": {"grant": grant.model_dump(by_alias=True)}})  # fmt: skip
    assert all(r for _, r, _ in conds.values())


def test_the_minds_reason_column_shows_without_wide_and_the_message_with_it() -> None:
    crd = yaml.safe_load((ROOT / "crds/continuum.dev_minds.yaml").read_text())
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Reason"].get("priority", 0) == 0
    assert columns["Message"]["priority"] == 1


# --- the Engine's journal ---------------------------------------------------------------------


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False))
def test_rfc3339_times_read_back_as_the_same_float(t: float) -> None:
    text = journal.rfc3339_exact(t)
    assert text.endswith("Z") and "T" in text
    assert journal.unix_of(text) == t


def test_the_journal_in_the_ledgers_status_has_no_float_times_and_recovers_exactly(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine(SERVING))
    w.mind(mind(NS, "ann", "coder"))
    w.loop.pass_once()
    step_doc = w.status("grantledgers", NS, "coder")[grant_ledger.STEP_FIELD]
    floats = [
        (k, v) for line in [step_doc, *step_doc["lines"]] for k, v in line.items()
        if k in ("t", "deadline") and isinstance(v, float)
    ]  # fmt: skip
    assert floats == [] and step_doc["t"].endswith("Z")
    # A new leader whose log lacks the step appends the same lines the old one would have.
    written = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    other = TransitionLog(tmp_path / "other.jsonl")
    assert other.recover(f"{NS}/coder", journal.read_journal(step_doc)) is True
    recovered = [json.loads(x) for x in (tmp_path / "other.jsonl").read_text().splitlines()]
    assert recovered == written
    assert checklog.check(recovered) == []


def test_a_journal_written_with_unix_seconds_still_recovers() -> None:
    old = {"seq": 3, "t": 11.5, "lines": [{"t": 11.5, "engine": "a/b", "deadline": None}]}
    assert journal.read_journal(old) == old
    assert journal.read_journal({"seq": 3, "lines": [{"t": "yesterday"}]}) is None


def test_check_log_accepts_the_phases_of_an_engine_not_serving_yet() -> None:
    lines = [
        {"t": 1.0, "engine": "a/e", "event": "capacity", "phase": phase, "slots": 1,
         "tokensPerSlot": 10}
        for phase in ("Unschedulable", "Starting")
    ] + [
        {"t": 2.0, "engine": "a/e", "event": "transition", "mind": "a/m", "from": None,
         "to": "Queued", "reason": "Arrived", "tokens": 0, "slot": None, "priority": 0,
         "protectionWindow": 0},
        {"t": 2.0, "engine": "a/e", "event": "transition", "mind": "a/m", "from": "Queued",
         "to": "Queued", "reason": "EngineStarting", "tokens": 0, "slot": None, "priority": 0,
         "protectionWindow": 0},
    ]  # fmt: skip
    assert checklog.check(lines) == []


# --- boards -----------------------------------------------------------------------------------


def test_a_boards_capacity_reads_in_gib_per_pool() -> None:
    board = NodeBoard.model_validate(
        yaml.safe_load((ROOT / "examples/boards/l4x2-discrete.yaml").read_text())
    )
    assert capacity_text(list(board.status.pools)) == (
        "host 124.0 GiB, device0 22.0 GiB, device1 22.0 GiB"
    )
    assert gib_text(None) == "none" and gib_text(28_570_000_000) == "26.6 GiB"
    assert capacity_text([]) == "no pools"


def test_the_example_boards_say_their_capacity_as_the_agent_would_write_it() -> None:
    for path in sorted((ROOT / "examples/boards").glob("*.yaml")):
        status = NodeBoard.model_validate(yaml.safe_load(path.read_text())).status
        assert status.capacity == capacity_text(list(status.pools)), path.name
        assert status.per_process_cap == gib_text(status.per_process_cap_bytes), path.name


def test_the_nodeboard_columns_print_the_human_fields() -> None:
    crd = yaml.safe_load((ROOT / "crds/continuum.dev_nodeboards.yaml").read_text())
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Capacity"]["jsonPath"] == ".status.capacity"
    assert columns["Cap"]["jsonPath"] == ".status.perProcessCap"


def test_the_agents_boards_carry_their_capacity_and_cap_in_gib() -> None:
    from tests.support.boards import board_of, fixture

    for name in ("a100x8", "apple-m5-unified", "no-nvml"):
        status = board_of(fixture(name), cap=8 * 2**30)
        assert status.capacity == capacity_text(list(status.pools)), name
        assert status.per_process_cap == gib_text(status.per_process_cap_bytes), name
        assert "GiB" in status.capacity
