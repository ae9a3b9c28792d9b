"""The gateway's decisions, without a server: admission, token caps and table changes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine.admission import (
    Answer,
    Cut,
    GrantTable,
    GrantTableError,
    OverGrant,
    Refusal,
    ServiceAccount,
    TableEntry,
    TokenCap,
    admit_request,
    admit_turn,
    engine_audience,
    identify,
    parse_table,
    prompt_token_bound,
    reconcile,
    service_account,
    still_reported,
    table_from_ledger,
    token_cap,
)
from continuum_operator.model.mind import GrantState

G, Q, R, X = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING, GrantState.RELEASED


def table(*entries: TableEntry, slot_tokens: int = 512, phase: str = "Serving") -> GrantTable:
    return GrantTable(slot_tokens, EnginePhase(phase), {e.mind: e for e in entries})


def granted(mind: str = "minds/mira", slot: int = 0, tokens: int = 512) -> TableEntry:
    return TableEntry(mind, G, "SlotFree", slot=slot, tokens=tokens, since="t0")


def reclaiming(mind: str = "minds/mira", slot: int = 0, since: str = "t1") -> TableEntry:
    return TableEntry(
        mind, R, "Preempted", slot=slot, tokens=512, by="minds/vip", deadline=100.0, since=since
    )


class TestOpeningATurn:
    def test_a_granted_mind_is_admitted_to_her_slot_with_her_tokens(self) -> None:
        adm = admit_turn(table(granted(slot=1)), "minds/mira")
        assert (adm.answer, adm.status, adm.slot, adm.tokens) == (Answer.ADMIT, 201, 1, 512)

    def test_a_queued_mind_is_told_to_wait_with_her_reason_and_place(self) -> None:
        t = table(
            TableEntry("minds/a", Q, "PoolFull"),
            TableEntry("minds/mira", Q, "WaitingForReclaim"),
        )
        adm = admit_turn(t, "minds/mira", queued_retry=3)
        assert (adm.status, adm.refusal, adm.retry_after) == (429, Refusal.QUEUED, 3)
        assert adm.body == {"error": "queued", "reason": "WaitingForReclaim", "position": 2}

    def test_a_reclaiming_grant_ends_the_turn_at_once_naming_the_preemptor(self) -> None:
        adm = admit_turn(table(reclaiming()), "minds/mira")
        assert (adm.status, adm.refusal, adm.retry_after) == (409, Refusal.RECLAIMING, 1)
        assert adm.body["by"] == "minds/vip"
        assert adm.body["deadline"] == "1970-01-01T00:01:40Z"

    def test_a_mind_not_in_the_table_is_forbidden(self) -> None:
        adm = admit_turn(table(granted()), "other/mind")
        assert (adm.status, adm.refusal) == (403, Refusal.FORBIDDEN)

    def test_asking_more_than_a_slot_is_refused_at_once(self) -> None:
        adm = admit_turn(table(granted()), "minds/mira", 1024)
        assert adm.status == 413
        assert adm.body == {"error": "context_too_large", "slotTokens": 512, "askedTokens": 1024}

    def test_a_mind_refused_as_too_large_by_the_operator_hears_it(self) -> None:
        t = table(TableEntry("minds/mira", X, "ContextTooLarge", asked_tokens=9000))
        assert admit_turn(t, "minds/mira").body["askedTokens"] == 9000

    @pytest.mark.parametrize("phase", ["Draining", "Relaunching"])
    def test_queued_minds_of_a_relaunching_engine_wait_for_the_relaunch(self, phase: str) -> None:
        adm = admit_turn(table(TableEntry("minds/mira", Q, "PoolFull"), phase=phase), "minds/mira")
        assert (adm.status, adm.body["reason"]) == (503, "EngineRelaunching")

    def test_a_granted_mind_waits_while_llama_server_is_not_ready(self) -> None:
        adm = admit_turn(table(granted()), "minds/mira", engine_ready=False)
        assert (adm.status, adm.refusal) == (503, Refusal.RELAUNCHING)

    def test_no_table_yet_means_nobody_is_granted(self) -> None:
        assert admit_turn(None, "minds/mira").status == 503

    def test_released_for_a_moment_before_requeue_reads_as_queued(self) -> None:
        t = table(TableEntry("minds/mira", X, "SlotReleased"))
        assert admit_turn(t, "minds/mira").status == 429


class TestRequestsInsideATurn:
    def test_a_granted_turn_runs_on_its_slot(self) -> None:
        adm = admit_request(table(granted(slot=1)), "minds/mira", 1)
        assert (adm.answer, adm.slot, adm.tokens) == (Answer.ADMIT, 1, 512)

    def test_a_reclaimed_grant_cuts_the_turn(self) -> None:
        adm = admit_request(table(reclaiming()), "minds/mira", 0)
        assert (adm.status, adm.refusal, adm.body["reason"]) == (409, Refusal.TURN_CUT, "Preempted")

    def test_a_requeued_mind_with_an_old_turn_is_cut(self) -> None:
        adm = admit_request(table(TableEntry("minds/mira", Q, "Requeued")), "minds/mira", 0)
        assert (adm.status, adm.body["reason"]) == (409, "Requeued")

    def test_a_queued_mind_asking_without_a_turn_hears_she_is_queued(self) -> None:
        adm = admit_request(table(TableEntry("minds/mira", Q, "PoolFull")), "minds/mira", None)
        assert (adm.status, adm.refusal) == (429, Refusal.QUEUED)

    def test_a_request_without_an_open_turn_is_not_found(self) -> None:
        adm = admit_request(table(granted()), "minds/mira", None)
        assert (adm.status, adm.refusal) == (404, Refusal.NO_TURN)

    def test_a_grant_moved_to_another_slot_ends_the_old_turn(self) -> None:
        adm = admit_request(table(granted(slot=1)), "minds/mira", 0)
        assert (adm.status, adm.body["reason"]) == (409, "SlotMoved")


class TestWhoIsAsking:
    def test_a_service_account_user_names_its_namespace_and_name(self) -> None:
        assert service_account("system:serviceaccount:minds:mira") == ServiceAccount(
            "minds", "mira"
        )
        assert service_account("system:serviceaccount:minds") is None
        assert service_account("system:serviceaccount:minds:a:b") is None
        assert service_account("kubernetes-admin") is None
        assert service_account(None) is None

    def test_a_token_speaks_for_the_mind_named_as_its_service_account(self) -> None:
        assert identify("", ServiceAccount("minds", "mira")) == ("minds/mira", None)
        assert identify("minds/mira", ServiceAccount("minds", "mira")) == ("minds/mira", None)

    def test_another_service_account_of_her_namespace_cannot_speak_for_her(self) -> None:
        # A child pod, or any other pod of her namespace, runs as another service account.
        _, other = identify("minds/mira", ServiceAccount("minds", "mira-child"))
        assert other is not None and (other.status, other.refusal) == (403, Refusal.FORBIDDEN)
        _, elsewhere = identify("minds/mira", ServiceAccount("elsewhere", "mira"))
        assert elsewhere is not None and elsewhere.status == 403

    def test_no_reviewed_token_is_unauthenticated_whatever_the_header_says(self) -> None:
        _, none = identify("minds/mira", None)
        assert none is not None and (none.status, none.refusal) == (401, Refusal.UNAUTHENTICATED)
        assert "Authorization: Bearer" in none.body["message"]

    def test_each_engine_has_an_audience_of_its_own(self) -> None:
        assert engine_audience("ml", "coder") == "continuum.dev/engine/ml/coder"
        assert engine_audience("ml", "coder") != engine_audience("ml", "coder-2")


class TestTokenCaps:
    def test_a_request_that_fits_keeps_its_n_predict(self) -> None:
        assert token_cap(512, 100, 50) == TokenCap(50, 50, capped=False)

    def test_a_request_over_the_grant_is_capped_to_what_is_left(self) -> None:
        assert token_cap(512, 100, 1000) == TokenCap(412, 1000, capped=True)

    def test_no_n_predict_means_as_many_as_fit(self) -> None:
        assert token_cap(512, 100, None) == TokenCap(412, None, capped=False)
        assert token_cap(512, 100, -1) == TokenCap(412, -1, capped=False)

    def test_a_prompt_filling_the_grant_is_refused(self) -> None:
        over = token_cap(512, 512, 10)
        assert over == OverGrant(512, 512)
        assert isinstance(over, OverGrant) and over.body()["error"] == "over_grant"

    @given(st.integers(1, 10_000), st.integers(0, 10_000), st.none() | st.integers(-1, 20_000))
    def test_prompt_and_generation_never_exceed_the_grant(
        self, grant: int, prompt: int, asked: int | None
    ) -> None:
        cap = token_cap(grant, prompt, asked)
        if isinstance(cap, OverGrant):
            assert prompt >= grant
        else:
            assert cap.n_predict >= (0 if asked == 0 else 1)
            assert prompt + cap.n_predict <= grant
            if asked is not None and 0 <= asked <= grant - prompt:
                assert cap.n_predict == asked

    def test_the_bound_of_a_prompt_covers_every_byte_and_the_specials(self) -> None:
        assert prompt_token_bound("héllo") == 6 + 4
        assert prompt_token_bound([1, 2, 3]) == 3 + 4
        assert prompt_token_bound([1, "ab"]) == 1 + 2 + 4 + 4
        assert prompt_token_bound([[1, 2], [3]]) is None
        assert prompt_token_bound(["one prompt", "another"]) is None
        assert prompt_token_bound(None) is None


class TestTableChanges:
    def test_a_reclaim_cuts_her_turn_and_releases_her_slot(self) -> None:
        plan = reconcile(table(reclaiming(slot=2)), {"minds/mira": 2})
        assert plan.cuts == (Cut("minds/mira", "Preempted", "minds/vip"),)
        assert [(r.mind, r.slot, r.reason, r.since) for r in plan.releases] == [
            ("minds/mira", 2, "Preempted", "t1")
        ]

    def test_a_reclaim_releases_the_slot_even_with_no_turn_open(self) -> None:
        plan = reconcile(table(reclaiming()), {})
        assert plan.cuts == () and len(plan.releases) == 1

    def test_a_release_is_made_once_per_reclaim(self) -> None:
        t = table(reclaiming(since="t1"))
        assert reconcile(t, {}, done={("minds/mira", 0, "t1")}).releases == ()
        # a later reclaim of the same mind and slot is another episode
        assert (
            len(
                reconcile(
                    table(reclaiming(since="t9")), {}, done={("minds/mira", 0, "t1")}
                ).releases
            )
            == 1
        )

    def test_a_mind_gone_from_the_table_is_cut(self) -> None:
        assert reconcile(table(), {"minds/mira": 0}).cuts == (Cut("minds/mira", "MindDeleted"),)

    def test_granted_minds_on_their_slots_are_left_alone(self) -> None:
        plan = reconcile(table(granted(slot=1)), {"minds/mira": 1})
        assert plan.cuts == () and plan.releases == ()

    def test_reported_releases_leave_once_the_operator_moved_the_grant_on(self) -> None:
        key = ("minds/mira", 0, "t1")
        assert still_reported(table(reclaiming()), {key}) == {key}
        assert still_reported(table(TableEntry("minds/mira", Q, "Requeued")), {key}) == set()
        assert still_reported(table(), {key}) == set()


class TestReadingTheTable:
    def test_a_table_document_reads_with_times_in_rfc3339(self) -> None:
        t = parse_table(
            {
                "slotTokens": 512,
                "phase": "Serving",
                "grants": [
                    {"mind": "minds/a", "state": "Granted", "slot": 0, "tokens": 512},
                    {
                        "mind": "minds/b",
                        "state": "Reclaiming",
                        "slot": 1,
                        "tokens": 512,
                        "reason": "Preempted",
                        "deadline": "2026-12-03T07:00:00Z",
                    },
                ],
            }
        )
        b = t.entry("minds/b")
        assert b is not None and b.state is R and b.deadline == 1796281200.0
        assert t.holder(1) == b

    @pytest.mark.parametrize(
        ("doc", "where"),
        [
            ({"grants": []}, "slotTokens"),
            ({"slotTokens": 8, "phase": "Asleep"}, "phase"),
            ({"slotTokens": 8, "grants": [{"mind": "nonamespace", "state": "Granted"}]}, "mind"),
            ({"slotTokens": 8, "grants": [{"mind": "a/b", "state": "Held"}]}, "state"),
            (
                {"slotTokens": 8, "grants": [{"mind": "a/b", "state": "Granted", "slot": -1}]},
                "slot",
            ),
            (
                {"slotTokens": 8, "grants": [{"mind": "a/b", "state": "Queued"}] * 2},
                "listed twice",
            ),
        ],
    )
    def test_a_bad_table_names_the_field(self, doc: dict[str, Any], where: str) -> None:
        with pytest.raises(GrantTableError, match=where):
            parse_table(doc)

    def test_a_grant_ledger_gives_its_status_grants_and_slot_size(self) -> None:
        status: dict[str, Any] = {
            "grants": [{"mind": "minds/a", "state": "Queued", "reason": "EngineRelaunching"}],
            "grantCapacity": {"phase": "Relaunching", "slots": 0, "tokensPerSlot": 1024},
        }
        obj = {
            "kind": "GrantLedger",
            "metadata": {"namespace": "minds", "name": "e"},
            "status": status,
        }
        t = table_from_ledger(obj)
        assert (t.slot_tokens, list(t.entries), t.left_out) == (1024, ["minds/a"], False)
        # a drain shows in her reason: she is told the engine relaunches
        assert admit_turn(t, "minds/a").status == 503
        # the head of a long queue: a mind it does not list waits behind it
        queue = {"queued": 9, "refused": 0, "keptQueued": 1, "keptRefused": 0}
        left_out = table_from_ledger({**obj, "status": {**status, "grantQueue": queue}})
        assert left_out.left_out and admit_turn(left_out, "minds/z").status == 429

    def test_a_ledgers_slot_size_is_its_launchs_not_the_engines_plan(self) -> None:
        """Draining: the granted minds hold slots of the old process, the one the gateway runs
        in, so its turns are capped by the old slot size the ledger was made for."""
        obj = {
            "metadata": {"namespace": "minds", "name": "e"},
            # an Engine body with the ledger merged in (the operator's cache) reads the same
            "spec": {"contextTokensPerMind": 4096},
            "status": {
                "plan": {"contextTokensPerMind": 4096},
                "grants": [{"mind": "minds/a", "state": "Granted", "slot": 0, "tokens": 2048}],
                "grantCapacity": {
                    "phase": "Draining",
                    "slots": 2,
                    "tokensPerSlot": 2048,
                    "launch": "old",
                    "targetSlots": 1,
                },
            },
        }
        t = table_from_ledger(obj)
        assert t.slot_tokens == 2048
        assert admit_turn(t, "minds/a").slot == 0

    @pytest.mark.parametrize(
        "status",
        [{}, {"grants": []}, {"grantCapacity": {"phase": "Serving", "slots": 1}}],
    )
    def test_a_ledger_without_a_slot_size_is_refused_naming_the_field(
        self, status: dict[str, Any]
    ) -> None:
        with pytest.raises(
            GrantTableError,
            match=r"GrantLedger minds/e status\.grantCapacity\.tokensPerSlot: missing.*"
            r"refused until the operator's next grant step writes",
        ):
            table_from_ledger({"metadata": {"namespace": "minds", "name": "e"}, "status": status})

    def test_a_ledgers_bad_slot_size_names_the_ledgers_field(self) -> None:
        obj = {
            "metadata": {"namespace": "minds", "name": "e"},
            "status": {"grantCapacity": {"phase": "Serving", "slots": 1, "tokensPerSlot": 0}},
        }
        with pytest.raises(
            GrantTableError,
            match=r"GrantLedger minds/e status\.grantCapacity\.tokensPerSlot: must be a positive",
        ):
            table_from_ledger(obj)
