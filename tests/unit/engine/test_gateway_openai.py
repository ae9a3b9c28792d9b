"""OpenAI's endpoints at the gateway, driven by the official `openai` client, in front of the
stand-in llama-server (tests/support/fake_llama.py); and the three findings of the attack on the
gateway (a client without a token spending another mind's grant, the tokenize storm, the late
cut of a stream). tests/e2e/test_openai.py runs the same client against the real llama-server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from continuum_operator.door.serving import serve_app
from continuum_operator.door.token_review import Caller
from continuum_operator.engine.admission import (
    ReviewUnavailable,
    ServiceAccount,
    TableEntry,
)
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.model.mind import GrantState
from tests.support import gateway as gateway_rig
from tests.support.fake_llama import FakeLlama
from tests.support.gateway import BOB, MIRA, VIP, Rig, granted, reclaiming, run, table
from tests.support.waiting import until

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


class TestAnUnmodifiedOpenAIClient:
    def test_chat_runs_on_her_slot_as_a_turn_of_one_request(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await rig.client().chat.completions.create(
                model="any", messages=HELLO, max_tokens=4
            )
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage is not None and reply.usage.completion_tokens == 4
            note = reply.model_extra["continuum"]  # type: ignore[index]
            assert (note["slot"], note["nPredict"], note["capped"]) == (1, 4, False)

        fake = run(table(granted(slot=1)), body)
        [sent] = fake.requests
        assert (sent["id_slot"], sent["n_predict"], sent["max_tokens"]) == (1, 4, 4)

    def test_max_completion_tokens_past_the_grant_is_capped_after_templating(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await rig.client().chat.completions.create(
                model="any", messages=HELLO, max_completion_tokens=100_000
            )
            note = reply.model_extra["continuum"]  # type: ignore[index]
            assert note["capped"] is True and note["cutOff"] == "GrantTokens"
            assert "fill the grant of 512 tokens" in note["message"]

        fake = run(table(granted()), body)
        [sent] = fake.requests
        templated = 1 + len(FakeLlama.template({"messages": HELLO}).split())
        assert sent["n_predict"] == 512 - templated  # the template's tokens counted too
        assert "max_completion_tokens" not in sent
        assert fake.tokenize_calls == 1

    def test_a_streamed_chat_arrives_as_events_and_ends_with_the_note(self) -> None:
        async def body(rig: Rig) -> None:
            stream = await rig.client().chat.completions.create(
                model="any", messages=HELLO, max_tokens=5, stream=True
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == " tok" * 5
            assert chunks[-1].model_extra["continuum"]["nPredict"] == 5  # type: ignore[index]

        run(table(granted()), body)

    def test_completions_and_models_are_served_to_her(self) -> None:
        async def body(rig: Rig) -> None:
            client = rig.client()
            done = await client.completions.create(model="any", prompt="one two", max_tokens=3)
            assert done.choices[0].text == " tok" * 3
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]

        fake = run(table(granted(slot=1)), body)
        [sent] = fake.requests
        assert (sent["id_slot"], sent["n_predict"]) == (1, 3)

    def test_an_engine_of_one_slot_embeds_generating_nothing(self) -> None:
        async def body(rig: Rig) -> None:
            await until(lambda: rig.gateway.slot_count == 1)
            emb = await rig.client().embeddings.create(model="any", input="one two")
            assert emb.data[0].embedding == [0.5, 0.5]

        fake = run(table(granted(slot=0)), body, FakeLlama(slots=1))
        [sent] = fake.requests
        assert sent["id_slot"] == 0 and "n_predict" not in sent

    def test_an_engine_of_several_slots_refuses_to_embed(self) -> None:
        # llama-server runs an embedding on any idle slot, whatever id_slot says.
        async def body(rig: Rig) -> None:
            await until(lambda: rig.gateway.slot_count == 2)
            with pytest.raises(openai.BadRequestError) as caught:
                await rig.client().embeddings.create(model="any", input="one two")
            assert "any idle slot" in caught.value.message

        assert run(table(granted()), body).requests == []

    def test_a_prompt_over_the_grant_is_refused_as_openai_clients_expect(self) -> None:
        async def body(rig: Rig) -> None:
            long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 600}]
            with pytest.raises(openai.BadRequestError) as caught:
                await rig.client().chat.completions.create(model="any", messages=long)
            err = caught.value
            assert err.code == "context_length_exceeded" and err.param == "messages"
            assert err.response.headers["x-should-retry"] == "false"

        fake = run(table(granted()), body)
        assert fake.requests == []  # refused before llama-server generated anything


class TestFieldsThatWouldLeaveTheSlotOrTheGrant:
    def test_n_of_two_is_refused_naming_the_field(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(openai.BadRequestError) as caught:
                await rig.client().chat.completions.create(model="any", messages=HELLO, n=2)
            assert caught.value.param == "n"
            assert "other minds' slots" in caught.value.message

        assert run(table(granted()), body).requests == []

    @pytest.mark.parametrize(
        ("endpoint", "field", "value"),
        [
            ("/v1/chat/completions", "n_cmpl", 2),
            ("/v1/chat/completions", "n_probs", 512),
            ("/v1/chat/completions", "lora", [{"id": 0, "scale": 1.0}]),
            ("/v1/chat/completions", "response_fields", ["content"]),
            ("/v1/chat/completions", "top_logprobs", 500),
            ("/v1/completions", "n_probs", 512),
            ("/v1/completions", "prompt", ["one", "two"]),  # two prompts: two slots
            ("/v1/completions", "best_of", 3),
            ("/v1/embeddings", "input", ["one", "two"]),
            ("/v1/embeddings", "dimensions", 8),
            ("/v1/chat/completions", "some_new_field", 1),  # an allow-list: unknown is refused
        ],
    )
    def test_each_is_refused_with_a_400_naming_it(
        self, endpoint: str, field: str, value: Any
    ) -> None:
        bases: dict[str, dict[str, Any]] = {
            "/v1/chat/completions": {"messages": HELLO},
            "/v1/completions": {"prompt": "hi"},
            "/v1/embeddings": {"input": "hi"},
        }
        base = bases[endpoint]

        async def body(rig: Rig) -> None:
            status, reply, _ = await rig.post(endpoint, {**base, field: value})
            assert status == 400
            assert reply["error"]["param"] == field
            assert reply["error"]["type"] == "invalid_request_error"
            assert field in reply["error"]["message"]

        assert run(table(granted()), body).requests == []

    def test_an_image_part_is_refused_as_no_bound_counts_it(self) -> None:
        async def body(rig: Rig) -> None:
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
            messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
            status, reply, _ = await rig.post("/v1/chat/completions", {"messages": messages})
            assert (status, reply["error"]["param"]) == (400, "messages[0].content[1]")

        run(table(granted()), body)


class TestGrantAnswersInOpenAIShape:
    def test_a_queued_mind_hears_429_with_retry_after_and_her_place(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(openai.RateLimitError) as caught:
                await rig.client().chat.completions.create(model="any", messages=HELLO)
            headers = caught.value.response.headers
            assert headers["retry-after"] == "2" and headers["x-should-retry"] == "true"
            assert caught.value.body["continuum"]["position"] == 1  # type: ignore[index]

        queued = TableEntry(MIRA, GrantState.QUEUED, "PoolFull")
        run(table(queued, granted(VIP)), body)

    def test_a_reclaiming_grant_is_refused_and_not_retried(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(openai.ConflictError) as caught:
                await rig.client().chat.completions.create(model="any", messages=HELLO)
            assert caught.value.response.headers["x-should-retry"] == "false"
            assert caught.value.code == "reclaiming"

        run(table(reclaiming()), body)

    def test_a_reclaim_during_a_stream_ends_it_with_an_event_saying_why(self) -> None:
        async def body(rig: Rig) -> None:
            stream = await rig.client().chat.completions.create(
                model="any", messages=HELLO, max_tokens=400, stream=True
            )
            seen = 0
            with pytest.raises(openai.APIError) as caught:
                async for _ in stream:
                    seen += 1
                    if seen == 3:
                        rig.gateway.set_table(table(reclaiming()))
            assert "turn cut" in caught.value.message and "Preempted" in caught.value.message
            assert seen < 50
            await until(lambda: bool(rig.gateway.releases()))

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0] and fake.erased == [0]

    def test_a_one_request_turn_leaves_her_explicit_turn_open(self) -> None:
        async def body(rig: Rig) -> None:
            status, opened, _ = await rig.post("/v1/turns", {})
            assert status == 201
            await rig.client().chat.completions.create(model="any", messages=HELLO, max_tokens=1)
            headers = {MIND_HEADER: MIRA, TURN_HEADER: opened["turn"]}
            status, _, _ = await rig.post("/completion", {"prompt": "hi", "n_predict": 1}, headers)
            assert status == 200

        run(table(granted()), body)


class TestFindingNoTokenSpendsAnothersGrant:
    """Found: a client with no token sent another mind's name, got her slot and her
    completion, and her own turn was dropped (404)."""

    def test_a_request_without_a_token_is_refused_and_her_turn_stays(self) -> None:
        async def body(rig: Rig) -> None:
            mira = {"Authorization": "Bearer mira-token"}
            status, opened, _ = await rig.post("/v1/turns", {}, mira)
            assert status == 201
            # The attacker names her, with no token, then with his own, then as her child.
            for headers in (
                {MIND_HEADER: MIRA},
                {MIND_HEADER: MIRA, "Authorization": "Bearer bob-token"},
                {MIND_HEADER: MIRA, "Authorization": "Bearer child-token"},
            ):
                for path in ("/v1/turns", "/completion", "/v1/chat/completions"):
                    status, reply, _ = await rig.post(path, {"messages": HELLO}, headers)
                    assert status in (401, 403), (path, headers, reply)
            with pytest.raises(openai.AuthenticationError):
                await rig.client(None).chat.completions.create(model="any", messages=HELLO)
            with pytest.raises(openai.PermissionDeniedError) as caught:
                await rig.client(MIRA, api_key="bob-token").chat.completions.create(
                    model="any", messages=HELLO
                )
            assert "speaks only for Mind minds/bob" in caught.value.message
            # Her turn is still hers, and her token alone says who she is.
            headers = {**mira, TURN_HEADER: opened["turn"]}
            status, reply, _ = await rig.post("/completion", {"prompt": "hi"}, headers)
            assert status == 200, reply
            mine = await rig.client(None, api_key="mira-token").chat.completions.create(
                model="any", messages=HELLO, max_tokens=1
            )
            assert mine.model_extra["continuum"]["slot"] == 0  # type: ignore[index]

        fake = run(table(granted(), granted(BOB, slot=1)), body, reviewed=True)
        assert [r["id_slot"] for r in fake.requests] == [0, 0]  # only hers ran, on her slot


class TestFindingAnOutageRefusedGoodTokens:
    """Found by review: a review the API server did not answer was a 401 with
    `x-should-retry: false`, telling a mind with a good token to give up for good."""

    def test_a_token_that_could_not_be_reviewed_is_a_503_to_send_again(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async def unavailable(token: str, caller: Caller | None = None) -> ServiceAccount | None:
            raise ReviewUnavailable("the API server did not answer the review: refused")

        monkeypatch.setattr(gateway_rig, "review", unavailable)
        mira = {"Authorization": "Bearer mira-token"}

        async def body(rig: Rig) -> None:
            status, reply, headers = await rig.post(
                "/v1/chat/completions", {"messages": HELLO}, mira
            )
            assert (status, headers["x-should-retry"], headers["Retry-After"]) == (503, "true", "2")
            assert reply["error"]["code"] == "review_unavailable", reply
            assert "send the request again" in reply["error"]["message"]
            status, reply, headers = await rig.post("/v1/turns", {}, mira)
            assert (status, reply["error"], headers["Retry-After"]) == (
                503,
                "review_unavailable",
                "2",
            )

        fake = run(table(granted()), body, reviewed=True)
        assert fake.requests == []


class TestFindingTheTokenizeStorm:
    """Found: a list prompt of 100 KB made 20,000 `/tokenize` calls and held its reclaim past
    the deadline with no release recorded."""

    def test_a_list_prompt_is_tokenized_once_whatever_its_pieces(self) -> None:
        async def body(rig: Rig) -> None:
            prompt = [7, *(["word", 7] * 150)]  # token ids and strings: one prompt
            status, reply, _ = await rig.post("/completion", {"prompt": prompt, "n_predict": 400})
            assert status == 200, reply
            assert reply["continuum"]["nPredict"] == 512 - (1 + 1 + 300)  # BOS, ids, words

        fake = run(table(granted()), body)
        assert fake.tokenize_calls == 1

    def test_more_pieces_than_the_grant_holds_are_refused_without_tokenizing(self) -> None:
        async def body(rig: Rig) -> None:
            prompt = [7, *(["w"] * 20_000)]
            status, reply, _ = await rig.post("/completion", {"prompt": prompt, "n_predict": 8})
            assert status == 400 and "20001 pieces" in reply["message"]

        assert run(table(granted()), body).tokenize_calls == 0

    def test_a_reclaim_during_tokenizing_is_released_before_its_deadline(self) -> None:
        async def body(rig: Rig) -> None:
            prompt = "word " * 400
            call = asyncio.create_task(rig.post("/completion", {"prompt": prompt}))
            await until(lambda: rig.fake.tokenize_calls == 1)
            started = time.monotonic()
            rig.gateway.set_table(table(reclaiming(seconds=2)))
            status, reply, _ = await call
            assert (status, reply["error"]) == (409, "turn_cut")
            await until(lambda: bool(rig.gateway.releases()), timeout=2)
            assert time.monotonic() - started < 1

        run(table(granted()), body, FakeLlama(tokenize_seconds=5))


class TestFindingTheLateCutOfAStream:
    """Found: a streamed request was cut at 4.8 s, a plain one at 0.3 s: the stream's wait for
    llama-server's headers (sent after the whole prompt is read) did not race the cut."""

    @pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
    def test_a_stream_waiting_for_its_headers_is_cut_at_once(self, path: str) -> None:
        async def body(rig: Rig) -> None:
            request: dict[str, Any] = {"prompt": "go", "n_predict": 8, "stream": True}
            if path != "/completion":
                request = {"messages": HELLO, "max_tokens": 8, "stream": True}
            status_body: list[Any] = []

            async def call() -> None:
                headers = {MIND_HEADER: MIRA}
                async with rig.http.post(f"{rig.url}{path}", json=request, headers=headers) as r:
                    status_body.append(r.status)
                    status_body.append(await r.read())

            task = asyncio.create_task(call())
            await until(lambda: bool(rig.fake.requests))
            started = time.monotonic()
            rig.gateway.set_table(table(reclaiming(seconds=10)))
            await task
            assert time.monotonic() - started < 1
            assert status_body[0] == 409
            error = json.loads(status_body[1])["error"]
            assert (error if path == "/completion" else error["code"]) == "turn_cut"
            await until(lambda: bool(rig.gateway.releases()), timeout=2)

        run(table(granted()), body, FakeLlama(headers_seconds=5))


def test_a_connection_that_never_finishes_its_headers_is_dropped() -> None:
    async def main() -> None:
        app = Gateway(GatewaySettings(upstream="http://127.0.0.1:9")).app()
        runner, address = await serve_app(app, "127.0.0.1", 0, headers_seconds=0.5)
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
            await writer.drain()
            started = time.monotonic()
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed by the gateway
            assert time.monotonic() - started < 2
            writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())
