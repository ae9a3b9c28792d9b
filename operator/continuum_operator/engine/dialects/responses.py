"""OpenAI's Responses (`/v1/responses`), translated to a chat and back.

As for Anthropic's Messages (`dialects.anthropic`), the gateway speaks it itself: the request
becomes a chat (`to_chat`) counted after the template, capped (`max_output_tokens`) and pinned
to her slot, sent to llama-server's `/v1/chat/completions`; the answer (`to_response`) and the
streamed chunks (`_Events`) are said back as Responses. One conversion, which the gateway both
counts and sends, so the count is the prompt llama-server runs. What Responses has that would
leave her turn (`previous_response_id`, `background`: state llama-server does not keep) or
her slot (fields llama-server reads, such as `n`, which no Responses client sends) is refused
by the allow-list, named. Refusals are in OpenAI's error shape (`dialects.openai`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from continuum_operator.engine.admission import OverGrant
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
    sse,
)
from continuum_operator.engine.dialects.openai import OpenAIErrors
from continuum_operator.engine.openai_api import SAMPLING, error_body, over_grant_body

CHAT_PATH = "/v1/chat/completions"

#: Fields said to llama-server, and fields read and dropped (`store`, `metadata`, `user`,
#: `include`, `truncation`, `reasoning`, `service_tier`, `prompt_cache_key`,
#: `safety_identifier`): none of them reaches another slot.
ALLOWED = (
    frozenset(
        {
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "text",
            "store",
            "metadata",
            "user",
            "include",
            "truncation",
            "reasoning",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
        }
    )
    | SAMPLING
)  # llama-server's own sampling fields, as on a chat: they stay in her slot

REFUSED_WHY = {
    "previous_response_id": "llama-server keeps no responses; send the conversation as input",
    "conversation": "llama-server keeps no conversations; send the conversation as input",
    "background": "a turn is answered while she waits, not stored for later",
    "n": "one answer per request (more would run on other minds' slots)",
    "n_cmpl": "it runs completions on other slots, overwriting other minds' KV cache",
    "id_slot": "the gateway pins her slot",
    "lora": "adapters are the engine's, not a request's",
    "n_probs": "probabilities up to the whole vocabulary",
    "prompt": "stored prompts are OpenAI's; send instructions and input",
}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Bad(where, f"{where}: a string or a list of text parts")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            # An image or a file is counted by no bound of bytes: not passed.
            raise Bad(f"{where}[{i}]", f"{where}[{i}]: only text parts are served")
        out.append(part["text"])
    return "".join(out)


def _item(item: Any, i: int, out: list[dict[str, Any]]) -> None:
    """One input item appended to the chat `out`."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise Bad(where, f"{where}: an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise Bad(f"{where}.role", f"{where}.role: user, assistant, system or developer")
        role = "system" if role == "developer" else role
        out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": str(item.get("call_id", "")),
            "type": "function",
            "function": {"name": str(item.get("name", "")), "arguments": item.get("arguments")},
        }
        if not isinstance(call["function"]["arguments"], str):  # type: ignore[index]
            raise Bad(f"{where}.arguments", f"{where}.arguments: a JSON string")
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = _content(item.get("output"), f"{where}.output")
        call_id = str(item.get("call_id", ""))
        out.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        return  # the model's own earlier thinking: not said again
    else:
        raise Bad(f"{where}.type", f"{where}.type: {kind!r} is not served (messages, "
                  "function_call and function_call_output are)")  # fmt: skip


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Bad("tools", "tools: a list of function tools")
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                why = "only function tools (run by the client) are served; the engine runs none"
                raise Bad(f"tools[{i}]", f"tools[{i}]: {why}")
            function = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            functions.append({"type": "function", "function": function})
        chat["tools"] = functions
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        raise Bad("tool_choice", "tool_choice: auto, none, required or a function")
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _format(body: dict[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise Bad("text.format", "text.format: text, json_object or json_schema")


def to_chat(body: dict[str, Any], grant_tokens: int) -> dict[str, Any]:
    """A Responses request said as a chat for llama-server (no slot, no cap yet)."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        instructions = _content(body["instructions"], "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        if len(given) > grant_tokens:
            raise Bad("input", f"input: more items than the grant's {grant_tokens} tokens")
        for i, item in enumerate(given):
            _item(item, i, messages)
    else:
        raise Bad("input", "input: a string or a non-empty list of items")
    if not messages:
        raise Bad("input", "input: nothing to answer")
    chat: dict[str, Any] = {"messages": messages}
    for name in SAMPLING | {"model"}:
        if name in body:
            chat[name] = body[name]
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    _tools(body, chat)
    _format(body, chat)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def check_count(body: Any, grant_tokens: int) -> dict[str, Any]:
    """A `/v1/responses/input_tokens` body said as the chat whose prompt is counted."""
    listed_object(body, ALLOWED, REFUSED_WHY)
    return to_chat({k: v for k, v in body.items() if k != "stream"}, grant_tokens)


def _usage(payload: dict[str, Any]) -> dict[str, Any]:
    usage = payload.get("usage") or {}
    given, made = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + made,
    }


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": f"msg_{rid}",
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def _call_item(rid: str, n: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "type": "function_call",
        "id": f"fc_{rid}_{n}",
        "call_id": call.get("id") or f"call_{rid}_{n}",
        "name": function.get("name") or "",
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def _response(rid: str, model: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    incomplete = status == "incomplete"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "metadata": {},
    }


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def to_response(payload: dict[str, Any], note: dict[str, Any]) -> dict[str, Any]:
    """llama-server's chat answer as a Response."""
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    rid = str(payload.get("id", ""))
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        text = {"type": "reasoning_text", "text": message["reasoning_content"]}
        output.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": [text]})
    if message.get("content"):
        output.append(_message_item(rid, message["content"]))
    for n, call in enumerate(message.get("tool_calls") or []):
        output.append(_call_item(rid, n, call, "completed"))
    finish = choice.get("finish_reason")
    out = _response(rid, str(payload.get("model", "")), _status(finish), output)
    out["usage"] = _usage(payload)
    out["continuum"] = note
    return out


@dataclass(slots=True)
class _Events(ChatChunks):
    """llama-server's chat chunks said as Responses' stream events."""

    rid: str = ""
    model: str = ""
    seq: int = 0
    open: dict[str, Any] | None = None  # the output item being written
    key: str | None = None  # "text" or "tool:<chat index>"
    output: list[dict[str, Any]] = field(default_factory=list)

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, kind)

    def delta(self, delta: dict[str, Any]) -> bytes:
        out = self._text(delta["content"]) if delta.get("content") else b""
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def start(self, chunk: dict[str, Any]) -> bytes:
        self.rid, self.model = str(chunk.get("id", "")), str(chunk.get("model", ""))
        shell = _response(self.rid, self.model, "in_progress", [])
        return self._event("response.created", response=shell) + self._event(
            "response.in_progress", response=shell
        )

    def _begin(self, key: str, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.key, self.open = key, item
        index = len(self.output)
        out += self._event("response.output_item.added", output_index=index, item=dict(item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
            item["_text"] = ""
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        if self.key != "text":
            item = _message_item(f"{self.rid}_{len(self.output)}", "", "in_progress")
            out += self._begin("text", item)
        assert self.open is not None
        self.open["_text"] += text
        return out + self._event(
            "response.output_text.delta",
            item_id=self.open["id"],
            output_index=len(self.output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        key = f"tool:{call.get('index', 0)}"
        if self.key != key:
            item = _call_item(self.rid, len(self.output), call, "in_progress")
            item["arguments"] = ""
            out += self._begin(key, item)
        assert self.open is not None
        piece = (call.get("function") or {}).get("arguments") or ""
        if not piece:
            return out
        self.open["arguments"] += piece
        return out + self._event(
            "response.function_call_arguments.delta",
            item_id=self.open["id"],
            output_index=len(self.output),
            delta=piece,
        )

    def _close(self) -> bytes:
        item, index = self.open, len(self.output)
        if item is None:
            return b""
        self.open = self.key = None
        out = b""
        if item["type"] == "message":
            text = item.pop("_text")
            done = _message_item(item["id"][len("msg_") :], text)
            out += self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=done["content"][0],
            )
        else:
            done = {**item, "status": "completed"}
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def failed(self, error: dict[str, Any]) -> bytes:
        message = f"llama-server: {error.get('message', error)}"
        return self._event(
            "error",
            code=error.get("type"),
            message=message,
            param=None,
            error={"message": message, "type": "server_error"},
        )

    def end(self) -> bytes:
        if self.ended or not self.started:
            return b""
        self.ended = True
        out = self._close()
        status = _status(self.finish)
        response = _response(self.rid, self.model, status, self.output)
        response["usage"] = _usage({"usage": self.usage})
        response["continuum"] = self.annotation
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)


class Responses(ChatTranslation, OpenAIErrors):
    """`POST /v1/responses`."""

    name = "openai /v1/responses"

    def check(self, body: Any, grant_tokens: int) -> None:
        listed_object(body, ALLOWED, REFUSED_WHY)
        asked = int_field(body, "max_output_tokens")
        if asked is not None and asked < 1:
            raise Bad("max_output_tokens", "max_output_tokens: a positive integer")
        to_chat(body, grant_tokens)

    def forward(self, body: dict[str, Any]) -> Forward:
        chat = to_chat(body, grant_tokens=2**62)  # the pieces were bounded by check
        asked = body.get("max_output_tokens")
        return Forward(CHAT_PATH, chat, Counting.CHAT, asked if isinstance(asked, int) else None)

    def answer(self, payload: Any, note: Annotate) -> Any:
        if not isinstance(payload, dict):
            return payload
        return to_response(payload, note(payload))

    def shaper(self, note: Annotate) -> _Events:
        return _Events(note)

    def over_grant(self, over: OverGrant) -> Reply:
        return Reply(400, over_grant_body(over, "input"), {SHOULD_RETRY_HEADER: "false"})

    def stream_error(self, kind: str, message: str, extra: dict[str, Any]) -> bytes:
        # Responses' error event; its `error` is what OpenAI's client raises (APIError).
        code = extra.get("reason", extra.get("code"))
        event = {"type": "error", "code": code, "message": message, "param": None}
        event["error"] = error_body(message, kind, code)["error"]
        event["continuum"] = {"error": kind, **extra}
        return sse(event, "error")
