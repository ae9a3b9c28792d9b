"""The dialects' translations alone (pure): Anthropic's Messages and OpenAI's Responses said as
a chat for llama-server, and llama-server's chat answers and chunks said back, tool calls
included (the stand-in llama-server of the other gateway tests makes no tool calls)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from continuum_operator.engine.dialects.anthropic import Messages
from continuum_operator.engine.dialects.base import Bad
from continuum_operator.engine.dialects.responses import Responses


def note(final: dict[str, Any]) -> dict[str, Any]:
    return {"slot": 1}


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    event = {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n"


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.splitlines() if b": " in line)
        if b"data" in lines:
            out.append((lines.get(b"event", b"").decode(), json.loads(lines[b"data"])))
    return out


CALL = [
    {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": ""},
    }
]
ARGS = [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n'


class TestAnthropic:
    def test_a_streamed_tool_call_is_a_tool_use_block(self) -> None:
        shaper = Messages().shaper(note)
        raw = b""
        for line in (chunk({"content": "Let me look."}), chunk({"tool_calls": CALL}),
                     chunk({"tool_calls": ARGS}), chunk({}, "tool_calls"), USAGE,
                     b"data: [DONE]\n"):  # fmt: skip
            said, _ = shaper.feed(line)
            raw += said
        kinds = [
            (name, e.get("content_block", e.get("delta", {})).get("type"))
            for name, e in events(raw)
        ]
        assert kinds == [
            ("message_start", None),
            ("content_block_start", "text"),
            ("content_block_delta", "text_delta"),
            ("content_block_stop", None),
            ("content_block_start", "tool_use"),
            ("content_block_delta", "input_json_delta"),
            ("content_block_stop", None),
            ("message_delta", None),
            ("message_stop", None),
        ]
        delta = events(raw)[-2][1]
        assert delta["delta"]["stop_reason"] == "tool_use"
        assert delta["usage"] == {"input_tokens": 7, "output_tokens": 3}

    def test_an_answers_tool_calls_are_tool_use_blocks_with_their_input(self) -> None:
        payload = {
            "id": "c",
            "model": "m",
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "content": "",
                        "tool_calls": [
                            {
                                **CALL[0],
                                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        }
        message = Messages().answer(payload, note)
        assert message["stop_reason"] == "tool_use"
        assert message["content"] == [
            {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}
        ]

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
            (
                {
                    "max_tokens": 4,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                        }
                    ],
                },
                "messages[0].content[0]",
            ),
            (
                {
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                },
                "tools[0]",
            ),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ],
    )
    def test_what_cannot_be_said_to_her_slot_is_refused_and_named(
        self, body: dict[str, Any], param: str
    ) -> None:
        with pytest.raises(Bad) as bad:
            Messages().check(body, 512)
        assert bad.value.param == param

    def test_her_system_prompt_tools_and_results_are_all_in_the_chat_counted(self) -> None:
        body = {
            "max_tokens": 4,
            "system": [{"type": "text", "text": "be brief"}],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "weather", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "c1",
                            "content": [{"type": "text", "text": "rain"}],
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
        fwd = Messages().forward(body)
        assert fwd.path == "/v1/chat/completions" and fwd.asked == 4
        roles = [m["role"] for m in fwd.body["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "user"]
        assert fwd.body["tools"][0]["function"]["parameters"] == {"type": "object"}
        assert fwd.body["tool_choice"] == "required"
        pinned = Messages().pin(fwd, 3, 2)
        assert (pinned["id_slot"], pinned["n_predict"], pinned["max_tokens"]) == (3, 2, 2)


class TestResponses:
    def test_a_streamed_tool_call_is_a_function_call_item(self) -> None:
        shaper = Responses().shaper(note)
        raw = b""
        for line in (chunk({"tool_calls": CALL}), chunk({"tool_calls": ARGS}),
                     chunk({}, "tool_calls"), USAGE, b"data: [DONE]\n"):  # fmt: skip
            out, _ = shaper.feed(line)
            raw += out
        said = events(raw)
        assert [name for name, _ in said] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        done = said[-1][1]["response"]
        assert done["output"][0]["arguments"] == '{"city": "Oslo"}'
        assert done["output"][0]["call_id"] == "call_1"
        assert done["usage"]["total_tokens"] == 10
        assert [e["sequence_number"] for _, e in said] == list(range(1, 8))

    def test_a_conversation_of_items_is_one_chat(self) -> None:
        body = {
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            ],
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_object"}},
        }
        fwd = Responses().forward(body)
        assert [m["role"] for m in fwd.body["messages"]] == ["system", "user", "assistant", "tool"]
        assert (fwd.asked, fwd.body["response_format"]) == (9, {"type": "json_object"})

    @pytest.mark.parametrize(
        ("extra", "param"),
        [
            ({"previous_response_id": "r"}, "previous_response_id"),
            ({"background": True}, "background"),
            ({"n": 2}, "n"),
            ({"tools": [{"type": "web_search"}]}, "tools[0]"),
            ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
        ],
    )
    def test_what_would_leave_her_turn_or_slot_is_refused_and_named(
        self, extra: dict[str, Any], param: str
    ) -> None:
        with pytest.raises(Bad) as bad:
            Responses().check({"input": "hi", **extra}, 512)
        assert bad.value.param == param


def test_an_error_llama_server_streams_is_said_as_each_apis_error_event() -> None:
    failure = (
        b'data: {"error": {"code": 500, "message": "decode failed", "type": "server_error"}}\n'
    )
    for shaper, name in ((Messages().shaper(note), "error"), (Responses().shaper(note), "error")):
        shaper.feed(chunk({"content": "a"}))
        out, _ = shaper.feed(failure)
        [(event, data)] = events(out)
        assert event == name and "decode failed" in json.dumps(data)
        assert shaper.end() == b""  # no closing events after the error


def test_what_claude_code_sends_on_every_request_passes() -> None:
    """Claude Code sends `context_management` (and caching, metadata) unconditionally: a
    gateway that refused it would refuse Claude Code altogether."""
    body = {
        "model": "any",
        "max_tokens": 32,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        "metadata": {"user_id": "u"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "temperature": 1,
    }
    Messages().check(body, 512)
    chat = Messages().forward(body).body
    assert "context_management" not in chat and chat["messages"][0]["role"] == "system"
