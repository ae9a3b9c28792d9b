"""The seam between the gateway and the APIs it speaks: what a dialect decides, as data.

The gateway (`engine.gateway`) does the same things for every API: it reads a body, admits
her, checks the body, counts her prompt, caps her generation, pins her slot, forwards, and
passes back the answer or its events, cut at a reclaim. What differs between APIs is only the
words: which fields may pass, how the prompt is found and the length asked, what is sent to
llama-server, and how a refusal, an answer, an event and a cut are shaped. A `Dialect` says
those words, pure (no I/O), and the gateway calls nothing else per API; the next API is one
new module beside `native`, `chat`, `anthropic` and `responses`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from continuum_operator.engine.admission import Admission, OverGrant
from continuum_operator.engine.openai_api import cap_body

#: OpenAI's clients read it before their own rule of what to retry (openai-python does, and
#: Anthropic's client too).
SHOULD_RETRY_HEADER = "x-should-retry"


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer the gateway sends as it is: status, JSON body, headers."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


class Counting(StrEnum):
    """How the prompt of a forwarded body is counted against her grant."""

    #: `prompt` (a string or token ids) and `n_predict`: llama-server's native `/completion`.
    NATIVE = "native"
    #: `messages`, counted after the model's chat template (`/apply-template`).
    CHAT = "chat"
    #: `prompt` of OpenAI's completions.
    TEXT = "text"
    #: `input` of an embedding: no generation, the input alone fits the grant.
    EMBED = "embed"


@dataclass(frozen=True, slots=True)
class Forward:
    """A body as llama-server reads it, where it goes, and how its prompt is counted."""

    path: str
    body: dict[str, Any]
    counting: Counting
    #: The generation asked for (None: as much as fits).
    asked: int | None


class Bad(Exception):
    """A body field the dialect does not pass: which, and what to do instead."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(message)


#: The gateway's note on a finished generation, from llama-server's last answer or event.
Annotate = Callable[[dict[str, Any]], dict[str, Any]]


class Shaper(Protocol):
    """The events of one stream, as llama-server writes them, in the dialect's words."""

    def feed(self, line: bytes) -> tuple[bytes, dict[str, Any] | None]:
        """What to send her for one line of llama-server's stream, and the generation's last
        event (usage, finish) when this line holds it."""
        ...

    def end(self) -> bytes:
        """What to send her when llama-server's stream ends of itself."""
        ...


class Dialect(Protocol):
    """One API of the door. Every method is pure."""

    @property
    def name(self) -> str:
        """Its name, for logs and docs."""
        ...

    @property
    def any_slot(self) -> bool:
        """Whether llama-server runs it on any idle slot, not hers: served by engines of one
        slot only."""
        ...

    def check(self, body: Any, grant_tokens: int) -> None:
        """Raise `Bad` for the first field that may not pass; `grant_tokens` bounds the pieces
        of a prompt (a list longer than the grant cannot fit)."""
        ...

    def forward(self, body: dict[str, Any]) -> Forward:
        """The body for llama-server (a checked one); `Bad` where it cannot be said there."""
        ...

    def pin(self, fwd: Forward, slot: int, n_predict: int | None) -> dict[str, Any]:
        """The forwarded body pinned to `slot`, generating at most `n_predict` tokens."""
        ...

    def answer(self, payload: Any, note: Annotate) -> Any:
        """llama-server's whole answer (200) in the dialect's words, with the gateway's note."""
        ...

    def shaper(self, note: Annotate) -> Shaper:
        """A shaper for one streamed answer."""
        ...

    def refusal(self, adm: Admission) -> Reply:
        """A refusal of the grant protocol (queued, cut, not hers, relaunching)."""
        ...

    def bad_request(self, param: str, message: str) -> Reply:
        """A body refused: which field, and why."""
        ...

    def over_grant(self, over: OverGrant) -> Reply:
        """The prompt alone fills her grant."""
        ...

    def stream_error(self, kind: str, message: str, extra: dict[str, Any]) -> bytes:
        """A stream's last event, when the gateway ends it (a cut): the SSE bytes."""
        ...

    def upstream_error(self, status: int, payload: Any) -> Reply:
        """llama-server refused the forwarded body itself (a malformed chat, say)."""
        ...


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (compact JSON, as llama-server writes)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def data_of(line: bytes) -> Any:
    """The JSON of an SSE `data:` line; None for any other line, `[DONE]` or bad JSON."""
    if not line.startswith(b"data:"):
        return None
    raw = line[5:].strip()
    if not raw or raw == b"[DONE]":
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def annotate_line(line: bytes, note: Annotate) -> tuple[bytes, dict[str, Any] | None]:
    """An event line with the gateway's note under `continuum`; and the event itself."""
    try:
        event = json.loads(line[len(b"data: ") :])
    except ValueError:
        return line, None
    if not isinstance(event, dict):
        return line, None
    event["continuum"] = note(event)
    return b"data: " + json.dumps(event).encode() + b"\n", event


def refusal_message(native: dict[str, Any]) -> str:
    """A refusal's words from the grant protocol's own answer (`admission`'s body)."""
    message = str(native.get("message") or "")
    if message:
        return message
    parts = [str(native.get("error"))]
    if native.get("reason"):
        parts.append(f"reason {native['reason']}")
    if native.get("by"):
        parts.append(f"by {native['by']}")
    if native.get("position"):
        parts.append(f"place in line {native['position']}")
    return ", ".join(parts)


def retry_headers(adm: Admission) -> dict[str, str]:
    """Retry-After where the protocol gives one; and whether a client should retry at all:
    only a wait in line (429) or a relaunch (503) is worth it."""
    headers = {"Retry-After": str(adm.retry_after)} if adm.retry_after else {}
    headers[SHOULD_RETRY_HEADER] = "true" if adm.status in (429, 503) else "false"
    return headers


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(name, f"{name}: expected an integer, got {value!r}")
    return value


def listed_object(body: Any, allowed: frozenset[str], why: Mapping[str, str]) -> dict[str, Any]:
    """`body`, a JSON object whose every field is on the allow-list."""
    if not isinstance(body, dict):
        raise Bad("", "the body is not a JSON object")
    listed_only(body, allowed, why)
    return body


@dataclass(frozen=True, slots=True)
class LastEvent:
    """llama-server's stream passed on as it is: only its last event (`is_last`, a cheap byte
    test) is parsed, to carry the gateway's note."""

    note: Annotate
    is_last: Callable[[bytes], bool]

    def feed(self, line: bytes) -> tuple[bytes, dict[str, Any] | None]:
        if not line.startswith(b"data: ") or not self.is_last(line):
            return line, None
        return annotate_line(line, self.note)

    def end(self) -> bytes:
        return b""


@dataclass(slots=True)
class ChatChunks:
    """llama-server's chat chunks said as another API's stream events: the shared reading
    (`[DONE]`, each chunk's deltas, its finish and its usage); a dialect says the rest
    (`start`, `delta`, `end`)."""

    note: Annotate
    started: bool = False
    ended: bool = False
    finish: str | None = None
    #: llama-server's usage (`prompt_tokens`, `completion_tokens`), once its chunk came.
    usage: dict[str, Any] = field(default_factory=dict)
    annotation: dict[str, Any] = field(default_factory=dict)

    def feed(self, line: bytes) -> tuple[bytes, dict[str, Any] | None]:
        if line.strip() == b"data: [DONE]":
            return self.end(), None
        chunk = data_of(line)
        if not isinstance(chunk, dict):
            return b"", None
        if isinstance(chunk.get("error"), dict):  # llama-server failed the generation
            self.ended = True
            return self.failed(chunk["error"]), None
        out = b""
        if not self.started:
            self.started = True
            out = self.start(chunk)
        final = None
        for choice in chunk.get("choices") or []:
            out += self.delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.annotation = self.note(chunk)
                final = chunk
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            final = chunk
        return out, final

    def start(self, chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def delta(self, delta: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        raise NotImplementedError

    def failed(self, error: dict[str, Any]) -> bytes:
        """llama-server's error event, said as the dialect's."""
        raise NotImplementedError


class PassThrough:
    """An API llama-server speaks itself: its answer passed on with the gateway's note."""

    def answer(self, payload: Any, note: Annotate) -> Any:
        if isinstance(payload, dict):
            payload["continuum"] = note(payload)
        return payload

    def upstream_error(self, status: int, payload: Any) -> Reply:
        return Reply(status, payload)


class ChatTranslation:
    """An API the gateway translates to a chat for llama-server (`/v1/chat/completions`): her
    slot is pinned and her generation capped on the chat, as for Chat Completions."""

    name = ""
    any_slot = False

    def pin(self, fwd: Forward, slot: int, n_predict: int | None) -> dict[str, Any]:
        return cap_body(fwd.body, slot, n_predict)


def listed_only(body: dict[str, Any], allowed: frozenset[str], why: Mapping[str, str]) -> None:
    """Every field of `body` on the allow-list: the first one not, refused with why. An
    allow-list: a field llama-server learns tomorrow does not pass by default."""
    for name in sorted(body):
        if name not in allowed:
            reason = why.get(name, "not served by this gateway")
            raise Bad(name, f"{name}: not accepted ({reason})")
