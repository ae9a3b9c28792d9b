"""The gateway's answers for tenancy (docs/tenancy.md): a mind refused for her class's token limit
is told so (413, not a wait in line), and a class-limited grant caps a turn at the grant's tokens,
not the slot's."""

from __future__ import annotations

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine.admission import (
    Answer,
    GrantTable,
    Refusal,
    TableEntry,
    admit_request,
    admit_turn,
)
from continuum_operator.model.mind import GrantState


def table(*entries: TableEntry) -> GrantTable:
    return GrantTable(512, EnginePhase.SERVING, {e.mind: e for e in entries})


def test_a_mind_refused_for_her_class_limit_is_answered_413_with_the_reason() -> None:
    refused = TableEntry("t/ann", GrantState.RELEASED, "ClassLimit", asked_tokens=300)
    adm = admit_turn(table(refused), "t/ann")
    assert (adm.status, adm.refusal, adm.retry_after) == (413, Refusal.CONTEXT_TOO_LARGE, None)
    assert adm.body == {"error": "context_too_large", "reason": "ClassLimit", "askedTokens": 300}


def test_a_class_limited_grant_admits_turns_with_its_own_tokens_not_the_slots() -> None:
    small = TableEntry("t/ann", GrantState.GRANTED, "SlotFree", slot=0, tokens=200, since="t0")
    adm = admit_turn(table(small), "t/ann")
    assert (adm.answer, adm.tokens) == (Answer.ADMIT, 200)
    over = admit_turn(table(small), "t/ann", asked_tokens=300)
    assert (over.status, over.body["slotTokens"]) == (413, 200)
    # Each request is capped at the grant's tokens (the gateway's n_predict bound).
    assert admit_request(table(small), "t/ann", 0).tokens == 200


def test_a_mind_her_class_does_not_allow_is_answered_403_not_told_to_wait() -> None:
    refused = TableEntry("dev/pager", GrantState.RELEASED, "ClassNotAllowed")
    adm = admit_turn(table(refused), "dev/pager")
    assert (adm.status, adm.refusal, adm.retry_after) == (403, Refusal.FORBIDDEN, None)
    assert adm.body["reason"] == "ClassNotAllowed"
    assert "her MindClass does not allow her namespace" in adm.body["message"]
