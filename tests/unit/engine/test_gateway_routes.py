"""Every llama-server route at the gateway: served, filtered or refused, and why
(docs/gateway.md, "Every route"). The decisions alone (pure), then through the gateway in
front of the stand-in llama-server (tests/support/fake_llama.py)."""

from __future__ import annotations

import logging

import anthropic
import openai
import pytest

from continuum_operator.engine.admission import TableEntry
from continuum_operator.engine.dialects.anthropic import Messages
from continuum_operator.engine.dialects.native import Native
from continuum_operator.engine.dialects.openai import OpenAI
from continuum_operator.engine.dialects.routes import (
    ROUTES,
    Decision,
    RateBucket,
    her_props,
    her_slots,
    not_served,
    shape_for,
)
from continuum_operator.engine.turn import MIND_HEADER
from tests.support.builders import ROOT
from tests.support.gateway import BOB, MIRA, Rig, claude, granted, run, table


class TestTheDecisions:
    def test_every_route_is_decided_once_and_each_refusal_says_why(self) -> None:
        seen = [(r.method, r.path) for r in ROUTES]
        assert len(seen) == len(set(seen))
        assert all(r.why for r in ROUTES)
        decided = {(r.method, r.path): r.decision for r in ROUTES}
        assert decided[("GET", "/metrics")] is Decision.REFUSED
        assert decided[("POST", "/slots/{id}")] is Decision.REFUSED
        assert decided[("GET", "/slots")] is Decision.FILTERED
        assert decided[("POST", "/v1/messages")] is Decision.SERVED

    def test_a_named_route_is_refused_with_its_reason_and_an_unknown_one_by_default(self) -> None:
        metrics = not_served("GET", "/metrics")
        assert metrics.status == 403 and "admin port" in metrics.body["message"]
        erase = not_served("POST", "/slots/3")
        assert erase.status == 403 and "erase" in erase.body["message"]
        tomorrow = not_served("POST", "/v1/something-new")
        assert tomorrow.status == 404 and "not a route of this gateway" in tomorrow.body["message"]

    def test_a_refusal_is_said_in_the_shape_of_the_api_its_path_belongs_to(self) -> None:
        assert isinstance(shape_for("/v1/messages/batches"), Messages)
        assert isinstance(shape_for("/v1/rerank"), OpenAI)
        assert isinstance(shape_for("/chat/completions"), OpenAI)
        assert isinstance(shape_for("/metrics"), Native)

    def test_the_bucket_lets_a_burst_through_then_says_how_long_to_wait(self) -> None:
        now = [0.0]
        bucket = RateBucket(per_second=2.0, burst=3, clock=lambda: now[0])
        assert [bucket.wait("mira") for _ in range(3)] == [0, 0, 0]
        assert bucket.wait("mira") == 1
        assert bucket.wait("bob") == 0  # each mind her own
        now[0] = 0.5
        assert bucket.wait("mira") == 0

    def test_props_say_her_grant_and_nothing_of_the_engine_or_other_minds(self) -> None:
        props = {
            "model_path": "/srv/secret.gguf",
            "total_slots": 4,
            "chat_template": "chatml",
            "default_generation_settings": {"n_ctx": 8192, "params": {}, "prompt": "theirs"},
        }
        hers = her_props(props, grant_tokens=512, slot=1)
        assert "model_path" not in hers and hers["total_slots"] == 1
        assert hers["default_generation_settings"] == {"n_ctx": 512, "params": {}}
        assert hers["chat_template"] == "chatml"

    def test_slots_show_her_own_and_what_it_holds_only_once_it_holds_hers(self) -> None:
        slots = [{"id": 0, "prompt": "bob's"}, {"id": 1, "prompt": "old", "n_ctx": 512}]
        assert her_slots(slots, 1, hers=True) == [slots[1]]
        assert her_slots(slots, 1, hers=False) == [{"id": 1, "n_ctx": 512}]
        assert her_slots(slots, None, hers=True) == []


def two() -> list[TableEntry]:
    return [granted(MIRA, slot=1), granted(BOB, slot=0)]


class TestThroughTheGateway:
    def test_the_unprefixed_aliases_are_served_as_llama_server_serves_them(self) -> None:
        async def body(rig: Rig) -> None:
            client = openai.AsyncOpenAI(
                base_url=rig.url, api_key="x", default_headers={MIND_HEADER: MIRA}, max_retries=0
            )
            rig.clients.append(client)
            reply = await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert (reply.model_extra or {})["continuum"]["slot"] == 1
            answered = await client.responses.create(model="any", input="hi", max_output_tokens=2)
            assert (answered.model_extra or {})["continuum"]["slot"] == 1
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            # llama-server's /completions is its native /completion, and so is the gateway's
            status, done, _ = await rig.post("/completions", {"prompt": "hi", "n_predict": 2})
            assert (status, done["continuum"]["slot"]) == (200, 1)
            # its /embeddings is its native embedding, on any idle slot: refused, named
            status, refused, _ = await rig.post("/embeddings", {"content": "hi"})
            assert status == 403 and "/v1/embeddings" in refused["message"]

        fake = run(table(granted(MIRA, slot=1), granted(BOB, slot=0)), body)
        assert [r["id_slot"] for r in fake.requests] == [1, 1, 1]

    def test_tokenize_is_hers_and_bounded_in_rate_and_size(self) -> None:
        async def body(rig: Rig) -> None:
            for _ in range(2):
                status, reply, _ = await rig.post("/tokenize", {"content": "a b c"})
                assert (status, len(reply["tokens"])) == (200, 3)
            status, reply, headers = await rig.post("/tokenize", {"content": "a"})
            assert (status, reply["error"], headers["Retry-After"]) == (429, "rate_limited", "1")
            status, reply, _ = await rig.post("/detokenize", {"tokens": [1, 2]}, {MIND_HEADER: BOB})
            assert (status, reply["content"]) == (200, "t1 t2")
            status, reply, _ = await rig.post(
                "/tokenize", {"content": "w" * 300_000}, {MIND_HEADER: BOB}
            )
            assert status == 413 and "bytes" in reply["message"]  # the body limits' answer
            status, reply, _ = await rig.post("/tokenize", {"content": "a"}, {MIND_HEADER: "x/y"})
            assert status == 403

        fake = run(table(granted(), granted(BOB, slot=1)), body, utility_burst=2)
        assert fake.tokenize_calls == 2  # neither the refused nor the stranger reached it

    def test_a_stranger_without_a_token_spends_no_tokenizing(self) -> None:
        async def body(rig: Rig) -> None:
            status, _, _ = await rig.post("/tokenize", {"content": "a"}, {})
            assert status == 401
            status, _, _ = await rig.post(
                "/tokenize", {"content": "a"}, {"Authorization": "Bearer mira-token"}
            )
            assert status == 200

        fake = run(table(granted()), body, reviewed=True)
        assert fake.tokenize_calls == 1

    def test_count_tokens_counts_what_the_gateway_would_send(self) -> None:
        async def body(rig: Rig) -> None:
            counted = await claude(rig).messages.count_tokens(
                model="any", system="be brief", messages=[{"role": "user", "content": "a b c"}]
            )
            template = rig.fake.template(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "a b c"},
                    ]
                }
            )
            assert counted.input_tokens == 1 + len(template.split())
            with pytest.raises(anthropic.BadRequestError) as caught:
                await claude(rig).messages.count_tokens(
                    model="any", messages=[{"role": "user", "content": "a"}], extra_body={"n": 2}
                )
            assert "n: not accepted" in caught.value.message
            status, reply, _ = await rig.post(
                "/v1/responses/input_tokens", {"model": "any", "input": "a b c"}
            )
            template = rig.fake.template({"messages": [{"role": "user", "content": "a b c"}]})
            assert status == 200
            assert reply == {
                "object": "response.input_tokens",
                "input_tokens": 1 + len(template.split()),
            }

        fake = run(table(granted()), body)
        assert fake.requests == []  # counting takes no slot

    def test_props_and_slots_are_filtered_to_hers(self) -> None:
        async def body(rig: Rig) -> None:
            status, props, _ = await rig.post_get("/props")
            assert status == 200 and "model_path" not in props
            assert props["default_generation_settings"]["n_ctx"] == 512
            assert props["continuum"] == {"slot": 1, "grantTokens": 512}
            status, slots, _ = await rig.post_get("/slots")
            assert status == 200 and [s["id"] for s in slots] == [1]

        run(table(*two()), body)

    def test_the_operators_routes_and_anothers_slot_are_refused_by_name(self) -> None:
        async def body(rig: Rig) -> None:
            status, reply, _ = await rig.post_get("/metrics")
            assert (status, reply["error"]) == (403, "not_served")
            assert "admin port" in reply["message"]
            status, reply, _ = await rig.post("/slots/0?action=erase", {})
            assert status == 403 and "erase" in reply["message"]
            status, reply, _ = await rig.post("/v1/rerank", {"query": "q", "documents": ["d"]})
            assert status == 403 and "any idle slot" in reply["error"]["message"]
            status, reply, _ = await rig.post("/v1/messages/batches", {})
            assert (status, reply["type"], reply["error"]["type"]) == (
                404,
                "error",
                "not_found_error",
            )

        fake = run(table(*two()), body)
        assert fake.erased == [] and fake.requests == []


def test_docs_say_every_route_as_the_table_decides_it() -> None:
    text = (ROOT / "docs" / "gateway.md").read_text()
    for r in ROUTES:
        assert f"| `{r.method} {r.path}` | {r.decision.value} | {r.why} |" in text, r


@pytest.mark.parametrize("asked", [False, True])
def test_a_line_per_request_on_the_access_log_only_where_asked(
    asked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's access log is off unless the settings ask for it: the metrics count every
    request, and the line cost each one a tenth of the gateway's calls."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")

    async def body(rig: Rig) -> None:
        status, _, _ = await rig.open()  # a route of the gateway's own, not llama-server's
        assert status == 201

    run(table(granted()), body, access_log=asked)
    logged = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len([line for line in logged if "POST /v1/turns" in line]) == int(asked), logged
