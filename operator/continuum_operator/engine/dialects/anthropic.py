"""Anthropic's Messages (`/v1/messages`), translated to a chat and back.

llama-server serves `/v1/messages` itself, but its conversion to a chat copies only a few
sampling fields: an `id_slot` sent with the body is dropped there, and llama-server may run
her request on another mind's slot. So the gateway speaks Messages itself: the body becomes
a chat (`to_chat`), which is counted after the template, capped and pinned to her slot like
any chat, sent to llama-server's `/v1/chat/completions`; the answer (`to_message`) and each
streamed chunk (`_Events`) are said back as Anthropic's client reads them. Refusals are in
Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, with the statuses
its client maps to its exception classes (docs/agents.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from continuum_operator.engine.admission import Admission, OverGrant
from continuum_operator.engine.dialects.base import (
    SHOULD_RETRY_HEADER,
    Annotate,
    Bad,
    ChatChunks,
    ChatTranslation,
    Counting,
    Forward,
    Reply,
    int_field,
    listed_object,
    refusal_message,
    retry_headers,
    sse,
)
from continuum_operator.engine.openai_api import SAMPLING

CHAT_PATH = "/v1/chat/completions"

#: The fields of a Messages request the gateway says to llama-server, and llama-server's own
#: sampling fields, as on a chat (they stay in her slot).
SAID = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
    }
)
#: Read and dropped: Anthropic's own metadata, tiers, context editing, caching and effort,
#: which Claude Code sends on every request (a block's `cache_control` too). Her grant bounds
#: the prompt, and a prompt past it is refused as "prompt is too long", which an agent answers
#: by compacting.
DROPPED = frozenset(
    {
        "metadata",
        "service_tier",
        "context_management",
        "cache_control",
        "output_config",
        "inference_geo",
    }
)
ALLOWED = SAID | DROPPED | SAMPLING
COUNT_ALLOWED = ALLOWED - {"max_tokens", "stream", "temperature", "top_p", "top_k"}

REFUSED_WHY = {
    "container": "containers are Anthropic's, not this engine's",
    "mcp_servers": "the engine reaches no other server",
    "id_slot": "the gateway pins her slot",
    "n": "one answer per request (more would run on other minds' slots)",
}

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error")


def error_body(status: int, message: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Anthropic's error shape; the gateway's own answer rides along under `continuum`."""
    error: dict[str, Any] = {"type": error_type(status), "message": message}
    if extra:
        error["continuum"] = extra
    return {"type": "error", "error": error}


def _text(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise Bad(where, f"{where}: a string or a list of text blocks")
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise Bad(f"{where}[{i}]", f"{where}[{i}]: only text blocks are served here")
        out.append(b["text"])
    return "\n".join(out)


def _user(content: list[Any], i: int) -> list[dict[str, Any]]:
    """A user turn: its tool results (each a `tool` message, first), then its text."""
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            text = _text(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                text = f"[error] {text}"
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            # An image or a document is counted by no bound of bytes: not passed.
            raise Bad(where, f"{where}: only text and tool_result blocks are served")
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(content: list[Any], i: int) -> dict[str, Any]:
    """An assistant turn: its text, its thinking and its tool calls, as one chat message."""
    out: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            out["content"] += block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            out["reasoning_content"] = block["thinking"]
        elif kind == "redacted_thinking":
            continue  # Anthropic's own, unreadable here
        elif kind == "tool_use" and isinstance(block.get("name"), str):
            arguments = json.dumps(block.get("input") or {})
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        else:
            raise Bad(where, f"{where}: only text, thinking and tool_use blocks are served")
    if calls:
        out["tool_calls"] = calls
    return out


def _messages(body: dict[str, Any], grant_tokens: int) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Bad("messages", "messages: a non-empty list of {role, content}")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    pieces = 0
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise Bad(f"messages[{i}]", f"messages[{i}]: an object with role user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise Bad(f"messages[{i}].content", f"messages[{i}].content: a string or blocks")
        pieces += 1 + len(content)
        out.extend(_user(content, i) if role == "user" else [_assistant(content, i)])
    if pieces > grant_tokens:
        raise Bad("messages", f"messages: more pieces than the grant's {grant_tokens} tokens")
    return out


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Bad("tools", "tools: a list of {name, description, input_schema}")
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                why = "only tools the client runs (custom) are served; the engine runs none"
                raise Bad(f"tools[{i}]", f"tools[{i}]: {why}")
            if not isinstance(t.get("name"), str):
                raise Bad(f"tools[{i}].name", f"tools[{i}].name: a string")
            function = {"name": t["name"], "parameters": t.get("input_schema") or {}}
            if isinstance(t.get("description"), str):
                function["description"] = t["description"]
            functions.append({"type": "function", "function": function})
        chat["tools"] = functions
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            name = {"name": str(choice.get("name", ""))}
            chat["tool_choice"] = {"type": "function", "function": name}
        elif kind in ("auto", "any", "none"):
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise Bad("tool_choice", "tool_choice: auto, any, tool or none")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False


def to_chat(body: dict[str, Any], grant_tokens: int) -> dict[str, Any]:
    """A Messages request said as a chat for llama-server (no slot, no cap yet)."""
    chat: dict[str, Any] = {"messages": _messages(body, grant_tokens)}
    for name in SAMPLING | {"model", "max_tokens"}:
        if name in body:
            chat[name] = body[name]
    if "stop_sequences" in body:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Bad("stop_sequences", "stop_sequences: a list of strings")
        chat["stop"] = stops
    _tools(body, chat)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        enabled = thinking["type"] == "enabled"
        chat["chat_template_kwargs"] = {"enable_thinking": enabled}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def check_count(body: Any, grant_tokens: int) -> dict[str, Any]:
    """A `/v1/messages/count_tokens` body said as the chat whose prompt is counted."""
    return to_chat(listed_object(body, COUNT_ALLOWED, REFUSED_WHY), grant_tokens)


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        out.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments")),
            }
        )
    return out


def _arguments(raw: Any) -> Any:
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"arguments": value}


def _usage(payload: dict[str, Any]) -> dict[str, int]:
    usage = payload.get("usage") or {}
    return {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
    }


def to_message(payload: dict[str, Any], note: dict[str, Any]) -> dict[str, Any]:
    """llama-server's chat answer as Anthropic's message."""
    choice = (payload.get("choices") or [{}])[0]
    return {
        "id": f"msg_{payload.get('id', '')}",
        "type": "message",
        "role": "assistant",
        "model": payload.get("model", ""),
        "content": _blocks(choice.get("message") or {}),
        "stop_reason": _STOP.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(payload),
        "continuum": note,
    }


@dataclass(slots=True)
class _Events(ChatChunks):
    """llama-server's chat chunks said as Anthropic's stream events."""

    index: int = -1
    block: str | None = None  # "text", "thinking", or "tool:<chat index>"

    def start(self, chunk: dict[str, Any]) -> bytes:
        message = {
            "id": f"msg_{chunk.get('id', '')}",
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model", ""),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}, "message_start")

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        if self.block == kind:
            return b""
        out = self._close()
        self.index += 1
        self.block = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + sse(start, "content_block_start")

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _say(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse(event, "content_block_delta")

    def delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._say({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out += self._say({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            kind = f"tool:{call.get('index', 0)}"
            if self.block != kind:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id") or "",
                    "name": function.get("name") or "",
                    "input": {},
                }
                out += self._open(kind, block)
            if function.get("arguments"):
                json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                out += self._say(json_delta)
        return out

    def failed(self, error: dict[str, Any]) -> bytes:
        message = f"llama-server: {error.get('message', error)}"
        return sse({"type": "error", "error": {"type": "api_error", "message": message}}, "error")

    def end(self) -> bytes:
        if self.ended or not self.started:
            return b""
        self.ended = True
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": _STOP.get(self.finish or "", "end_turn"),
                "stop_sequence": None,
            },
            "usage": _usage({"usage": self.usage}),
            "continuum": self.annotation,
        }
        return (
            self._close()
            + sse(delta, "message_delta")
            + sse({"type": "message_stop"}, "message_stop")
        )


class Messages(ChatTranslation):
    """`POST /v1/messages`."""

    name = "anthropic /v1/messages"

    def check(self, body: Any, grant_tokens: int) -> None:
        listed_object(body, ALLOWED, REFUSED_WHY)
        asked = int_field(body, "max_tokens")
        if asked is None or asked < 1:
            raise Bad("max_tokens", "max_tokens: a positive integer (Anthropic's API asks it)")
        to_chat(body, grant_tokens)  # every message said, or the first that cannot be

    def forward(self, body: dict[str, Any]) -> Forward:
        # The grant's pieces were bounded by check (a piece is at least one token).
        chat = to_chat(body, grant_tokens=2**62)
        return Forward(CHAT_PATH, chat, Counting.CHAT, int(body["max_tokens"]))

    def answer(self, payload: Any, note: Annotate) -> Any:
        if not isinstance(payload, dict):
            return payload
        return to_message(payload, note(payload))

    def shaper(self, note: Annotate) -> _Events:
        return _Events(note)

    def refusal(self, adm: Admission) -> Reply:
        body = error_body(adm.status, refusal_message(adm.body), adm.body)
        return Reply(adm.status, body, retry_headers(adm))

    def bad_request(self, param: str, message: str) -> Reply:
        body = error_body(400, message, {"param": param})
        return Reply(400, body, {SHOULD_RETRY_HEADER: "false"})

    def over_grant(self, over: OverGrant) -> Reply:
        # Anthropic's own words for an over-long prompt, with the grant's.
        message = (
            f"prompt is too long: {over.prompt_tokens} tokens > {over.grant_tokens} maximum "
            "(your grant on this engine): shorten it"
        )
        return Reply(400, error_body(400, message, over.body()), {SHOULD_RETRY_HEADER: "false"})

    def stream_error(self, kind: str, message: str, extra: dict[str, Any]) -> bytes:
        error = {"type": "api_error", "message": message, "continuum": {"error": kind, **extra}}
        return sse({"type": "error", "error": error}, "error")

    def upstream_error(self, status: int, payload: Any) -> Reply:
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        text = str(message or payload)
        return Reply(status, error_body(status, f"llama-server: {text}", {"upstream": payload}))
