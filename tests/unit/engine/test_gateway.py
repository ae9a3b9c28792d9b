"""The gateway in front of a stand-in llama-server (tests/support/fake_llama.py).

Each test serves a grant table, talks to the gateway over loopback HTTP as a mind would, and
checks both the answers and what reached llama-server. The same behaviours run against the
real llama-server in tests/e2e/test_gateway_llama.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine import gateway_requests
from continuum_operator.engine.admission import GrantTable
from continuum_operator.engine.grants_source import watch_file
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER, TurnCut, turn
from continuum_operator.model.mind import GrantState
from tests.support.fake_llama import FakeLlama
from tests.support.gateway import MIRA, VIP, Rig, granted, queued, reclaiming, run, table
from tests.support.waiting import until


class TestServingGrantedMinds:
    def test_a_granted_mind_runs_completions_pinned_to_her_slot(self) -> None:
        async def body(rig: Rig) -> None:
            status, opened, _ = await rig.open()
            assert (status, opened["slot"], opened["tokens"]) == (201, 1, 512)
            status, reply = await rig.complete(
                opened["turn"], {"prompt": "hello there", "n_predict": 4, "id_slot": 0}
            )
            assert status == 200, reply
            assert (reply["id_slot"], reply["tokens_predicted"]) == (1, 4)
            assert reply["continuum"]["capped"] is False and "cutOff" not in reply["continuum"]
            async with rig.http.get(f"{rig.admin_url}/metrics") as resp:
                text = await resp.text()
            assert 'continuum_gateway_slot_requests_total{slot="1"} 1.0' in text
            assert 'continuum_gateway_slot_tokens_total{kind="predicted",slot="1"} 4.0' in text
            assert 'continuum_gateway_slot_busy{slot="1"} 0.0' in text

        fake = run(table(granted(slot=1)), body)
        assert [(r["id_slot"], r["n_predict"]) for r in fake.requests] == [(1, 4)]

    @pytest.mark.parametrize(
        "field,value",
        [("n_cmpl", 2), ("n", 2), ("n_probs", 150_000), ("lora", [{"id": 0, "scale": 1.0}]),
         ("n_keep", -1), ("verbose", True)],
    )  # fmt: skip
    def test_a_native_completion_is_refused_a_field_that_leaves_her_slot(
        self, field: str, value: object
    ) -> None:
        # llama-server's /completion runs n_cmpl (or n) completions on other minds' idle slots,
        # overwriting their KV cache; n_probs up to the vocabulary is a reply the gateway holds
        # whole in memory. The same allow-list rule as the OpenAI endpoints, with native names.
        answers: list[tuple[int, Any]] = []

        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            answers.append(
                await rig.complete(opened["turn"], {"prompt": "hi", "n_predict": 2, field: value})
            )
            status, reply = await rig.complete(
                opened["turn"], {"prompt": "hi", "n_predict": 2, "n": 1, "n_probs": 5}
            )
            assert status == 200, reply

        fake = run(table(granted(slot=1)), body)
        status, reply = answers[0]
        assert (status, reply["error"]) == (400, "bad_request")
        assert reply["message"].startswith(f"{field}: ")
        assert [r.get("n_probs") for r in fake.requests] == [5]  # only the second passed

    def test_minds_not_granted_get_the_protocols_answers(self) -> None:
        async def body(rig: Rig) -> None:
            status, answer, headers = await rig.open("minds/ann")
            assert (status, answer["reason"], answer["position"]) == (429, "PoolFull", 1)
            assert headers["Retry-After"] == "2"
            status, answer, _ = await rig.open(MIRA)
            assert (status, answer["error"], answer["by"]) == (409, "reclaiming", VIP)
            status, answer, _ = await rig.open("other/stranger")
            assert (status, answer["error"]) == (403, "forbidden")
            status, answer, _ = await rig.open(VIP, contextTokens=4096)
            assert (status, answer["slotTokens"], answer["askedTokens"]) == (413, 512, 4096)
            async with rig.http.get(f"{rig.admin_url}/metrics") as resp:
                text = await resp.text()
            for reason in ("queued", "reclaiming", "forbidden", "context_too_large"):
                assert f'continuum_gateway_refusals_total{{reason="{reason}"}} 1.0' in text

        fake = run(table(queued("minds/ann"), reclaiming(), granted(VIP, slot=1)), body)
        assert fake.requests == []

    def test_a_relaunching_engine_asks_queued_minds_to_wait(self) -> None:
        async def body(rig: Rig) -> None:
            status, answer, headers = await rig.open("minds/ann")
            assert (status, answer["reason"], headers["Retry-After"]) == (
                503,
                "EngineRelaunching",
                "5",
            )

        run(table(queued("minds/ann"), phase=EnginePhase.RELAUNCHING), body)

    def test_a_request_without_its_turn_is_refused(self) -> None:
        async def body(rig: Rig) -> None:
            status, answer = await rig.complete("t-made-up", {"prompt": "hi"})
            assert (status, answer["error"]) == (404, "no_turn")

        run(table(granted()), body)

    def test_a_mind_that_hangs_up_stops_her_generation_in_llama_server(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened = (await rig.open())[:2]
            call = asyncio.create_task(
                rig.complete(opened["turn"], {"prompt": "long", "n_predict": 400})
            )
            await until(lambda: 0 in rig.fake.busy)
            call.cancel()  # her connection closes
            await asyncio.gather(call, return_exceptions=True)
            await until(lambda: not rig.fake.busy and not rig.gateway.flights)

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0]


class TestTokens:
    def test_a_mind_asking_past_her_grant_is_capped_and_told_she_was_cut_off(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            status, reply = await rig.complete(
                opened["turn"], {"prompt": "a b c", "n_predict": 10_000}
            )
            assert status == 200
            note = reply["continuum"]
            # 1 BOS + 3 words of prompt: 508 tokens left of the grant of 512
            assert (note["nPredict"], note["nPredictAsked"], note["capped"]) == (508, 10_000, True)
            assert note["cutOff"] == "GrantTokens" and "512" in note["message"]
            assert reply["tokens_predicted"] == 508

        fake = run(table(granted()), body, FakeLlama(token_seconds=0))
        assert fake.requests[0]["n_predict"] == 508

    def test_a_slot_smaller_than_the_grant_caps_at_the_slot(self) -> None:
        async def body(rig: Rig) -> None:
            rig.gateway.slot_ctx = 100  # llama-server capped its slots below the grant
            _, opened, _ = await rig.open()
            status, reply = await rig.complete(opened["turn"], {"prompt": "a b c"})
            assert (status, reply["continuum"]["grantTokens"], reply["tokens_predicted"]) == (
                200,
                100,
                96,
            )

        run(table(granted()), body, FakeLlama(token_seconds=0))

    def test_a_prompt_larger_than_the_grant_is_refused_before_llama_server(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            status, reply = await rig.complete(opened["turn"], {"prompt": "w " * 600})
            assert (status, reply["error"], reply["promptTokens"], reply["grantTokens"]) == (
                413,
                "over_grant",
                601,
                512,
            )

        assert run(table(granted()), body).requests == []

    def test_a_small_request_is_not_tokenized_twice(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            status, _ = await rig.complete(opened["turn"], {"prompt": "short", "n_predict": 8})
            assert status == 200

        # the fake's /tokenize would count 2; the bound (5 bytes + 4) + 8 fits in 512 anyway
        fake = run(table(granted()), body)
        assert fake.requests[0]["n_predict"] == 8


class TestReclaims:
    def test_a_reclaim_cuts_a_plain_request_erases_the_slot_and_reports_it(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            call = asyncio.create_task(
                rig.complete(opened["turn"], {"prompt": "long", "n_predict": 400})
            )
            await until(lambda: rig.fake.n_past.get(0, 0) > 4)
            started = time.monotonic()
            rig.gateway.set_table(table(reclaiming()))
            status, reply = await call
            assert time.monotonic() - started < 2
            assert (status, reply["error"], reply["reason"], reply["by"]) == (
                409,
                "turn_cut",
                "Preempted",
                VIP,
            )
            await until(lambda: bool(rig.gateway.releases()))
            [release] = rig.gateway.releases()
            assert (release.mind, release.slot, release.reason, release.grant_since) == (
                MIRA,
                0,
                "Preempted",
                "r",
            )
            assert (
                release.erased_tokens is not None and release.erased_tokens > 2
            )  # her prompt and what she had generated
            assert rig.fake.n_past.get(0, 0) == 0
            rig.gateway.set_table(table(reclaiming()))  # the same table again: one cut
            text = rig.gateway.metrics.exposition().decode()
            assert 'continuum_gateway_turns_cut_total{reason="Preempted"} 1.0' in text
            assert 'continuum_gateway_slot_releases_total{reason="Preempted"} 1.0' in text
            # her next request and her next turn are refused; she is not waiting on anything
            status, reply = await rig.complete(opened["turn"], {"prompt": "again"})
            assert (status, reply["error"]) == (409, "turn_cut")

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0] and fake.erased == [0]

    def test_a_reclaim_ends_a_stream_with_a_turn_cut_event(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            events: list[dict[str, Any]] = []
            async with rig.http.post(
                f"{rig.url}/completion",
                json={"prompt": "go", "n_predict": 400, "stream": True},
                headers={MIND_HEADER: MIRA, TURN_HEADER: opened["turn"]},
            ) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))
                        if len(events) == 3:
                            rig.gateway.set_table(table(reclaiming()))
            assert events[-1] == {"error": {"type": "turn_cut", "reason": "Preempted"}}
            assert len(events) < 50
            await until(lambda: bool(rig.gateway.releases()))

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0]

    def test_a_finished_stream_says_when_the_grant_cut_it_off(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            async with rig.http.post(
                f"{rig.url}/completion",
                json={"prompt": "go", "stream": True},
                headers={MIND_HEADER: MIRA, TURN_HEADER: opened["turn"]},
            ) as resp:
                lines = [line async for line in resp.content if line.startswith(b"data: ")]
            final = json.loads(lines[-1][6:])
            assert final["stop"] is True and final["continuum"]["cutOff"] == "GrantTokens"

        run(table(granted()), body, FakeLlama(token_seconds=0))

    def test_the_release_leaves_the_report_once_the_operator_recorded_it(self) -> None:
        async def body(rig: Rig) -> None:
            rig.gateway.set_table(table(reclaiming()))
            await until(lambda: bool(rig.gateway.releases()))
            rig.gateway.set_table(table(reclaiming()))  # the same reclaim: not released twice
            await asyncio.sleep(0.05)
            assert len(rig.gateway.releases()) == 1
            rig.gateway.set_table(table(queued(MIRA, "Requeued")))
            assert rig.gateway.releases() == []

        fake = run(table(granted()), body)
        assert fake.erased == [0]

    def test_a_slot_forced_free_is_erased_before_its_next_holder_runs(self) -> None:
        async def body(rig: Rig) -> None:
            _, opened, _ = await rig.open()
            await rig.complete(opened["turn"], {"prompt": "secret words here", "n_predict": 3})
            assert rig.fake.n_past[0] == 7
            # the operator moves the slot on without a reported release (grace expired)
            rig.gateway.set_table(table(queued(MIRA, "Requeued"), granted(VIP, slot=0)))
            _, vip, _ = await rig.open(VIP)
            status, _ = await rig.complete(vip["turn"], {"prompt": "x", "n_predict": 1}, mind=VIP)
            assert status == 200
            assert rig.fake.n_past[0] == 3  # only her own prompt and token

        fake = run(table(granted()), body)
        assert fake.erased == [0]

    def test_the_seed_deadlock_cannot_form_with_the_turn_client(self) -> None:
        """A turn in progress, her grant reclaimed: the turn ends at once, the reclaim proceeds
        without her, and she is regranted and takes her next turn."""

        async def body(rig: Rig) -> None:
            started = time.monotonic()
            with pytest.raises(TurnCut):
                async with turn(rig.url, MIRA, deadline_seconds=1500, session=rig.http) as t:
                    work = asyncio.create_task(t.complete({"prompt": "think", "n_predict": 400}))
                    await until(lambda: 0 in rig.fake.busy)
                    rig.gateway.set_table(table(reclaiming()))  # a relaunch, say
                    await work
            await until(lambda: bool(rig.gateway.releases()))
            assert time.monotonic() - started < 5  # not her 1,500 s deadline

            # the operator records the release: she is requeued, then regranted
            rig.gateway.set_table(table(queued(MIRA, "Requeued")))

            async def regrant() -> None:
                await asyncio.sleep(0.2)
                rig.gateway.set_table(table(granted()))

            later = asyncio.create_task(regrant())
            async with turn(
                rig.url, MIRA, deadline_seconds=10, poll_seconds=0.05, session=rig.http
            ) as t:
                reply = await t.complete({"prompt": "again", "n_predict": 2})
                assert reply["tokens_predicted"] == 2
                assert [w.reason for w in t.waits] == ["Requeued"]
            await later

        run(table(granted()), body, FakeLlama(token_seconds=0.01))


def test_the_grant_file_is_watched_and_a_bad_edit_keeps_the_last_table(tmp_path: Path) -> None:
    path = tmp_path / "grants.yaml"
    path.write_text("slotTokens: 512\ngrants:\n- {mind: minds/mira, state: Queued}\n")
    seen: list[GrantTable] = []

    async def main() -> None:
        watcher = asyncio.create_task(watch_file(path, seen.append, poll_seconds=0.01))
        await until(lambda: len(seen) == 1)
        path.write_text("slotTokens: [not a number\n")
        await asyncio.sleep(0.05)
        path.write_text("slotTokens: 512\ngrants:\n- {mind: minds/mira, state: Granted, slot: 0}\n")
        await until(lambda: len(seen) == 2)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run(main())
    assert [t.entries["minds/mira"].state for t in seen] == [GrantState.QUEUED, GrantState.GRANTED]


@dataclass
class EchoingLlama(FakeLlama):
    """llama-server's last event of a native stream repeats the prompt (and its settings)."""

    echoed: str = ""

    def _final(self, slot: int, prompt: int, predicted: int) -> dict[str, Any]:
        return {**super()._final(slot, prompt, predicted), "prompt": self.echoed}


async def _streamed(rig: Rig, prompt: str) -> bytes:
    _, opened, _ = await rig.open()
    async with rig.http.post(
        f"{rig.url}/completion",
        json={"prompt": prompt, "n_predict": 3, "stream": True},
        headers={MIND_HEADER: MIRA, TURN_HEADER: opened["turn"]},
    ) as resp:
        assert resp.status == 200
        return await resp.read()


class TestFindingTheLongLastEvent:
    """Found by review: a stream whose last event passed aiohttp's line limit (128 KiB: a
    prompt of some 600 KB, echoed back) broke off with no last event and no note."""

    def test_a_last_event_that_echoes_a_long_prompt_ends_the_stream_with_its_note(self) -> None:
        prompt = "x" * 600_000  # one word for the fake's tokenizer
        got: list[bytes] = []

        async def body(rig: Rig) -> None:
            got.append(await _streamed(rig, prompt))

        run(table(granted(slot=0)), body, EchoingLlama(echoed=prompt))
        last = json.loads(got[0].strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        assert last["stop"] is True and last["continuum"]["slot"] == 0

    def test_an_event_past_the_gateways_limit_ends_the_stream_with_an_error_event(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(gateway_requests, "STREAM_LINE_BYTES", 4096)
        got: list[bytes] = []

        async def body(rig: Rig) -> None:
            got.append(await _streamed(rig, "y" * 10_000))

        run(table(granted(slot=0)), body, EchoingLlama(echoed="y" * 10_000))
        last = json.loads(got[0].strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == 502 and "4096 bytes" in last["error"]["message"]
