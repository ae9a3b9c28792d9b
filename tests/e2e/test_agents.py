"""Every agent's door, against the real llama-server behind the gateway: the official
`anthropic` client on Anthropic's Messages and the official `openai` client on OpenAI's
Responses (tests/e2e/test_openai.py runs Chat Completions). On a generated model with no chat
template of its own (llama-server falls back to chatml).

Each runs on her slot (slot 0, which llama-server would pick first for a request it may place
anywhere, is never touched), capped to her grant; a prompt over the grant, a queued mind and
another mind's token are refused with each client's own exception class; a reclaim during a
stream of each ends it within the grace with the reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import openai
import pytest

from continuum_operator.door.token_review import Caller
from continuum_operator.engine.admission import ServiceAccount, TableEntry
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.model.mind import GrantState
from tests.support.gateway_llama_openai import (
    ENDLESS,
    MIRA,
    SLOT_TOKENS,
    VIP,
    Engine,
    granted,
    model,
    run_engine,
    table,
)
from tests.support.llama_server import TinyModel

pytestmark = pytest.mark.e2e

# A fixture, used by name: the generated model of tests/support/gateway_llama_openai.py (8k
# context, two slots of 4k).
__all__ = ["model"]

ANN = "minds/ann"
#: A grant less than her slot: the gateway counts her prompt (after the template) to cap her.
GRANT = 256
HELLO: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Once upon a time"}]
TOOL: anthropic.types.ToolParam = {
    "name": "weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def claude(e: Engine, mind: str | None = MIRA, key: str = "unused") -> anthropic.AsyncAnthropic:
    """An agent as written for Anthropic: only the base URL is the engine's."""
    client = anthropic.AsyncAnthropic(
        base_url=e.url,
        api_key=key,
        default_headers={MIND_HEADER: mind} if mind else None,
        max_retries=0,
    )
    e.clients.append(client)  # type: ignore[arg-type]  # closed with the others
    return client


async def untouched(e: Engine) -> bool:
    """Slot 0 (not hers) never ran a task."""
    return "id_task" not in (await e.slots())[0]


def reclaim() -> TableEntry:
    return TableEntry(
        MIRA,
        GrantState.RECLAIMING,
        "Preempted",
        slot=1,
        tokens=SLOT_TOKENS,
        by=VIP,
        deadline=time.time() + 10,
        since="r1",
    )


def test_messages_plain_streamed_with_system_and_tools_and_counted_run_on_her_slot(
    llama_server_bin: Path, model: TinyModel
) -> None:
    async def body(e: Engine) -> None:
        agent = claude(e)
        reply = await agent.messages.create(
            model="tiny", max_tokens=4, system="be brief", messages=HELLO, extra_body=ENDLESS
        )
        assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 4
        assert (reply.model_extra or {})["continuum"]["slot"] == 1
        assert await untouched(e)
        counted = await agent.messages.count_tokens(model="tiny", system="be brief", messages=HELLO)
        assert counted.input_tokens == reply.usage.input_tokens  # llama-server's own count

        async with agent.messages.stream(
            model="tiny", max_tokens=6, messages=HELLO, extra_body=ENDLESS
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"
        assert text and final.content[0].type == "text" and final.content[0].text == text

        tooled = await agent.messages.create(
            model="tiny", max_tokens=20_000, messages=HELLO, tools=[TOOL], extra_body=ENDLESS
        )
        # Her grant (less than her slot) holds the templated prompt, tool definitions included.
        note = (tooled.model_extra or {})["continuum"]
        assert note["capped"] and note["nPredict"] + tooled.usage.input_tokens == GRANT
        assert tooled.usage.output_tokens == note["nPredict"] and note["cutOff"] == "GrantTokens"
        assert await untouched(e)

    run_engine(llama_server_bin, model, table(granted(tokens=GRANT)), body)


def test_responses_plain_and_streamed_run_on_her_slot(
    llama_server_bin: Path, model: TinyModel
) -> None:
    async def body(e: Engine) -> None:
        agent = e.agent()
        reply = await agent.responses.create(
            model="tiny",
            instructions="be brief",
            input="Once upon a time",
            max_output_tokens=4,
            extra_body=ENDLESS,
        )
        assert reply.status == "incomplete" and reply.output_text
        assert reply.usage is not None and reply.usage.output_tokens == 4
        assert (reply.model_extra or {})["continuum"]["slot"] == 1
        stream = await agent.responses.create(
            model="tiny", input="Once upon a time", max_output_tokens=5, stream=True,
            extra_body=ENDLESS,
        )  # fmt: skip
        events = [event async for event in stream]
        assert events[0].type == "response.created"
        last = events[-1]
        assert last.type == "response.incomplete"
        assert last.response.usage is not None and last.response.usage.output_tokens == 5
        assert await untouched(e)

    run_engine(llama_server_bin, model, table(granted()), body)


def test_over_grant_queued_and_anothers_token_are_each_clients_own_errors(
    llama_server_bin: Path, model: TinyModel
) -> None:
    tokens = {
        "mira-token": ServiceAccount("minds", "mira"),
        "ann-token": ServiceAccount("minds", "ann"),
    }

    async def review(token: str, caller: Caller | None = None) -> ServiceAccount | None:
        return tokens.get(token)

    async def body(e: Engine) -> None:
        mine = claude(e, None, "mira-token")
        long: list[anthropic.types.MessageParam] = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await mine.messages.create(model="tiny", max_tokens=4, messages=long)
        assert "prompt is too long" in too_long.value.message
        responses = openai.AsyncOpenAI(base_url=f"{e.url}/v1", api_key="mira-token", max_retries=0)
        e.clients.append(responses)
        with pytest.raises(openai.BadRequestError) as exceeded:
            await responses.responses.create(model="tiny", input="word " * 200)
        assert exceeded.value.code == "context_length_exceeded"

        queued = claude(e, None, "ann-token")
        with pytest.raises(anthropic.RateLimitError) as waiting:
            await queued.messages.create(model="tiny", max_tokens=4, messages=HELLO)
        assert waiting.value.response.headers["retry-after"] == "2"
        queued_oai = openai.AsyncOpenAI(base_url=f"{e.url}/v1", api_key="ann-token", max_retries=0)
        e.clients.append(queued_oai)
        with pytest.raises(openai.RateLimitError) as waiting_oai:
            await queued_oai.responses.create(model="tiny", input="hi")
        assert waiting_oai.value.response.headers["retry-after"] == "2"

        with pytest.raises(anthropic.PermissionDeniedError):  # Ann's token naming Mira
            await claude(e, MIRA, "ann-token").messages.create(
                model="tiny", max_tokens=4, messages=HELLO
            )
        with pytest.raises(anthropic.AuthenticationError):
            await claude(e, MIRA, "nobody").messages.create(
                model="tiny", max_tokens=4, messages=HELLO
            )
        assert await untouched(e) and "id_task" not in (await e.slots())[1]

    ann = TableEntry(ANN, GrantState.QUEUED, "PoolFull")
    run_engine(llama_server_bin, model, table(granted(tokens=96), ann), body, review_token=review)


def test_a_reclaim_ends_a_messages_stream_and_a_responses_stream_within_the_grace(
    llama_server_bin: Path, model: TinyModel
) -> None:
    async def body(e: Engine) -> None:
        seen, cut_at = 0, 0.0
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with claude(e).messages.stream(
                model="tiny", max_tokens=4000, messages=HELLO, extra_body=ENDLESS
            ) as stream:
                async for _ in stream.text_stream:
                    seen += 1
                    if seen == 5:
                        cut_at = time.monotonic()
                        e.gateway.set_table(table(reclaim()))
        assert time.monotonic() - cut_at < 2.0
        assert "turn cut" in caught.value.message and "Preempted" in caught.value.message

        e.gateway.set_table(table(granted()))  # granted again, on a new grant
        events = await e.agent().responses.create(
            model="tiny", input="Once upon a time", max_output_tokens=4000, stream=True,
            extra_body=ENDLESS,
        )  # fmt: skip
        seen = 0
        with pytest.raises(openai.APIError) as cut:
            async for _ in events:
                seen += 1
                if seen == 8:
                    cut_at = time.monotonic()
                    e.gateway.set_table(table(reclaim()))
        assert time.monotonic() - cut_at < 2.0
        assert "turn cut" in cut.value.message and "Preempted" in cut.value.message

    run_engine(llama_server_bin, model, table(granted()), body)
