"""Anthropic's Messages and OpenAI's Responses at the gateway, driven by the official
`anthropic` and `openai` clients in front of the stand-in llama-server
(tests/support/fake_llama.py). Each runs on her slot (the stand-in asserts the `id_slot` it is sent
and fills that slot's cache), capped to her grant, and each refusal is the client's own exception
class. tests/e2e/test_agents.py runs the same clients against the real llama-server.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from continuum_operator.engine.admission import TableEntry
from continuum_operator.model.mind import GrantState
from tests.support.fake_llama import FakeLlama
from tests.support.gateway import BOB, MIRA, Rig, claude, granted, reclaiming, run, table
from tests.support.waiting import until

HELLO: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello there"}]
ANN = "minds/ann"


def two_minds() -> list[TableEntry]:
    """Mira on slot 1, Bob on slot 0: a request of hers that lands on slot 0 is seen."""
    return [granted(MIRA, slot=1), granted(BOB, slot=0)]


class TestAnthropicMessages:
    def test_a_message_runs_on_her_slot_and_is_said_in_anthropics_words(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await claude(rig).messages.create(
                model="any", max_tokens=4, messages=HELLO, system="be brief"
            )
            assert reply.stop_reason == "max_tokens"
            assert reply.content[0].type == "text" and reply.content[0].text == " tok" * 4
            assert reply.usage.output_tokens == 4
            note = (reply.model_extra or {})["continuum"]
            assert (note["slot"], note["nPredict"]) == (1, 4)

        fake = run(table(*two_minds()), body)
        [sent] = fake.requests
        assert sent["id_slot"] == 1 and 0 not in fake.n_past  # her slot, never Bob's
        assert sent["messages"][0] == {"role": "system", "content": "be brief"}

    def test_a_streamed_message_runs_on_her_slot(self) -> None:
        async def body(rig: Rig) -> None:
            async with claude(rig).messages.stream(
                model="any", max_tokens=5, messages=HELLO
            ) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert text == " tok" * 5
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5

        fake = run(table(*two_minds()), body)
        assert [r["id_slot"] for r in fake.requests] == [1] and 0 not in fake.n_past

    def test_max_tokens_past_the_grant_is_capped(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await claude(rig).messages.create(
                model="any", max_tokens=20_000, messages=HELLO
            )
            note = (reply.model_extra or {})["continuum"]
            assert note["capped"] and note["nPredict"] + reply.usage.input_tokens == 512

        run(table(granted()), body)

    def test_tools_and_tool_results_are_said_to_llama_server_and_counted(self) -> None:
        tool: anthropic.types.ToolParam = {
            "name": "weather",
            "description": "the weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
        turns: list[anthropic.types.MessageParam] = [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Oslo"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "rain"}],
            },
        ]

        async def body(rig: Rig) -> None:
            await claude(rig).messages.create(
                model="any", max_tokens=2, messages=turns, tools=[tool]
            )

        fake = run(table(granted()), body)
        [sent] = fake.requests
        assert sent["tools"][0]["function"]["name"] == "weather"
        assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
        assert sent["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "rain"}

    def test_a_prompt_past_the_grant_is_refused_as_too_long(self) -> None:
        async def body(rig: Rig) -> None:
            long: list[anthropic.types.MessageParam] = [{"role": "user", "content": "w " * 600}]
            with pytest.raises(anthropic.BadRequestError) as caught:
                await claude(rig).messages.create(model="any", max_tokens=4, messages=long)
            assert "prompt is too long" in caught.value.message
            assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

        fake = run(table(granted()), body)
        assert fake.requests == []

    def test_a_field_that_would_leave_her_slot_is_refused_and_named(self) -> None:
        async def body(rig: Rig) -> None:
            for extra in ({"n": 2}, {"id_slot": 0}, {"container": "x"}):
                with pytest.raises(anthropic.BadRequestError) as caught:
                    await claude(rig).messages.create(
                        model="any", max_tokens=4, messages=HELLO, extra_body=extra
                    )
                assert f"{next(iter(extra))}: not accepted" in caught.value.message

        fake = run(table(granted()), body)
        assert fake.requests == []

    def test_a_queued_mind_reads_a_rate_limit_with_its_retry_header(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(anthropic.RateLimitError) as caught:
                await claude(rig, ANN).messages.create(model="any", max_tokens=4, messages=HELLO)
            assert caught.value.response.headers["retry-after"] == "2"
            assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

        run(table(granted(), TableEntry(ANN, GrantState.QUEUED, "PoolFull")), body)

    def test_her_token_in_x_api_key_is_her_key_and_anothers_is_refused(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await claude(rig, None, "mira-token").messages.create(
                model="any", max_tokens=1, messages=HELLO
            )
            assert (reply.model_extra or {})["continuum"]["slot"] == 1
            with pytest.raises(anthropic.PermissionDeniedError):
                await claude(rig, MIRA, "bob-token").messages.create(
                    model="any", max_tokens=1, messages=HELLO
                )
            with pytest.raises(anthropic.AuthenticationError):
                await claude(rig, MIRA, "nobody").messages.create(
                    model="any", max_tokens=1, messages=HELLO
                )

        fake = run(table(*two_minds()), body, reviewed=True)
        assert [r["id_slot"] for r in fake.requests] == [1]

    def test_a_reclaim_during_a_stream_ends_it_with_an_error_event_saying_why(self) -> None:
        async def body(rig: Rig) -> None:
            seen = 0
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with claude(rig).messages.stream(
                    model="any", max_tokens=400, messages=HELLO
                ) as stream:
                    async for _ in stream.text_stream:
                        seen += 1
                        if seen == 3:
                            rig.gateway.set_table(table(reclaiming()))
            assert "turn cut" in caught.value.message and "Preempted" in caught.value.message
            assert seen < 50
            await until(lambda: bool(rig.gateway.releases()))

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0] and fake.erased == [0]


class TestOpenAIResponses:
    def test_a_response_runs_on_her_slot_capped_by_max_output_tokens(self) -> None:
        async def body(rig: Rig) -> None:
            reply = await rig.client().responses.create(
                model="any", input="hello there", instructions="be brief", max_output_tokens=3
            )
            assert reply.output_text == " tok" * 3
            assert reply.status == "incomplete"
            assert reply.usage is not None and reply.usage.output_tokens == 3
            capped = await rig.client().responses.create(
                model="any", input="hello", max_output_tokens=100_000
            )
            note = (capped.model_extra or {})["continuum"]
            assert note["capped"] and capped.usage is not None
            assert note["nPredict"] + capped.usage.input_tokens == 512

        fake = run(table(*two_minds()), body)
        assert [r["id_slot"] for r in fake.requests] == [1, 1] and 0 not in fake.n_past
        assert fake.requests[0]["messages"][0] == {"role": "system", "content": "be brief"}

    def test_a_streamed_response_runs_on_her_slot(self) -> None:
        async def body(rig: Rig) -> None:
            stream = await rig.client().responses.create(
                model="any", input="hello there", max_output_tokens=4, stream=True
            )
            events = [e async for e in stream]
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == " tok" * 4
            assert events[0].type == "response.created"
            assert events[-1].type == "response.incomplete"
            assert events[-1].response.output_text == " tok" * 4

        fake = run(table(*two_minds()), body)
        assert [r["id_slot"] for r in fake.requests] == [1]

    def test_what_would_leave_her_turn_or_slot_is_refused_and_named(self) -> None:
        async def body(rig: Rig) -> None:
            for name, value in (("previous_response_id", "resp_1"), ("n", 2), ("id_slot", 0)):
                with pytest.raises(openai.BadRequestError) as caught:
                    await rig.client().responses.create(
                        model="any", input="hi", extra_body={name: value}
                    )
                assert caught.value.param == name
            with pytest.raises(openai.BadRequestError) as image:
                await rig.client().responses.create(
                    model="any",
                    input=[
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "input_image",
                                    "image_url": "http://x/y.png",
                                    "detail": "auto",
                                }
                            ],
                        }
                    ],
                )
            assert image.value.param == "input[0].content[0]"

        fake = run(table(granted()), body)
        assert fake.requests == []

    def test_a_prompt_past_the_grant_is_context_length_exceeded(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(openai.BadRequestError) as caught:
                await rig.client().responses.create(model="any", input="w " * 600)
            assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "input")

        run(table(granted()), body)

    def test_a_queued_mind_reads_a_rate_limit_with_its_retry_header(self) -> None:
        async def body(rig: Rig) -> None:
            with pytest.raises(openai.RateLimitError) as caught:
                await rig.client(ANN).responses.create(model="any", input="hi")
            assert caught.value.response.headers["retry-after"] == "2"

        run(table(granted(), TableEntry(ANN, GrantState.QUEUED, "PoolFull")), body)

    def test_a_reclaim_during_a_stream_ends_it_with_an_error_saying_why(self) -> None:
        async def body(rig: Rig) -> None:
            stream = await rig.client().responses.create(
                model="any", input="hello", max_output_tokens=400, stream=True
            )
            seen = 0
            with pytest.raises(openai.APIError) as caught:
                async for _ in stream:
                    seen += 1
                    if seen == 5:
                        rig.gateway.set_table(table(reclaiming()))
            assert "turn cut" in caught.value.message and "Preempted" in caught.value.message
            assert seen < 60

        fake = run(table(granted()), body, FakeLlama(token_seconds=0.01))
        assert fake.cancelled == [0]


class TestWhereHerSlotIsHerGrant:
    """The runtime reads each slot's size; where her grant is the whole slot, llama-server's
    own bound is her grant (it refuses a prompt the slot cannot hold and ends a generation
    where the slot is full): no template is asked to count her prompt."""

    def test_no_template_is_asked_and_the_grant_holds_in_each_api(self) -> None:
        async def body(rig: Rig) -> None:
            rig.gateway.slot_ctx = 512  # as the runtime reads it from /slots
            reply = await rig.client().chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hello"}]
            )
            note = (reply.model_extra or {})["continuum"]
            assert note["cutOff"] == "GrantTokens" and reply.usage is not None
            assert reply.usage.total_tokens == 512
            message = await claude(rig).messages.create(model="any", max_tokens=3, messages=HELLO)
            assert message.usage.output_tokens == 3
            long = "w " * 600
            with pytest.raises(openai.BadRequestError) as chat:
                await rig.client().chat.completions.create(
                    model="any", messages=[{"role": "user", "content": long}]
                )
            assert chat.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as response:
                await rig.client().responses.create(model="any", input=long)
            assert response.value.code == "context_length_exceeded"
            with pytest.raises(anthropic.BadRequestError) as messages:
                await claude(rig).messages.create(
                    model="any", max_tokens=4, messages=[{"role": "user", "content": long}]
                )
            assert "prompt is too long" in messages.value.message

        fake = run(table(granted()), body)
        assert (fake.template_calls, fake.tokenize_calls) == (0, 0)

    def test_with_context_shift_the_slot_bounds_nothing_and_the_prompt_is_counted(self) -> None:
        async def body(rig: Rig) -> None:
            rig.gateway.slot_ctx = 512
            reply = await claude(rig).messages.create(model="any", max_tokens=3, messages=HELLO)
            assert (reply.model_extra or {})["continuum"]["nPredict"] == 3

        fake = run(table(granted()), body, context_shift=True)
        assert fake.template_calls == 1
