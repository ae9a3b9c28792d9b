"""OpenAI's Chat Completions, Completions and Embeddings: llama-server's own OpenAI endpoints,
passed through with the grant enforced (docs/gateway.md, "OpenAI's API").

Its allow-lists and error shapes are `engine.openai_api`'s; here they are said as a dialect of
the door. The stream is llama-server's, passed on line by line: only its last event (the one
whose `finish_reason` is set) is parsed, to carry the gateway's note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from continuum_operator.engine.admission import Admission, OverGrant
from continuum_operator.engine.dialects.base import (
    SHOULD_RETRY_HEADER,
    Annotate,
    Bad,
    Counting,
    Forward,
    LastEvent,
    PassThrough,
    Reply,
    retry_headers,
    sse,
)
from continuum_operator.engine.openai_api import (
    Endpoint,
    FieldError,
    asked_tokens,
    cap_body,
    check_body,
    error_body,
    over_grant_body,
    refusal_body,
)

_COUNTING = {
    Endpoint.CHAT: Counting.CHAT,
    Endpoint.COMPLETIONS: Counting.TEXT,
    Endpoint.EMBEDDINGS: Counting.EMBED,
}
_PROMPT_PARAM = {Endpoint.CHAT: "messages", Endpoint.COMPLETIONS: "prompt"}


def _finishes(line: bytes) -> bool:
    # The chunk whose finish_reason is set (llama-server writes compact JSON).
    return b'"finish_reason":"' in line


class OpenAIErrors:
    """Refusals in OpenAI's shape (Chat Completions, Completions, Embeddings, Responses)."""

    def refusal(self, adm: Admission) -> Reply:
        return Reply(adm.status, refusal_body(adm), retry_headers(adm))

    def bad_request(self, param: str, message: str) -> Reply:
        return Reply(400, FieldError(param, message).body(), {SHOULD_RETRY_HEADER: "false"})

    def upstream_error(self, status: int, payload: Any) -> Reply:
        return Reply(status, payload)


@dataclass(frozen=True, slots=True)
class OpenAI(OpenAIErrors, PassThrough):
    """One of OpenAI's endpoints, by its path (the same path on llama-server)."""

    endpoint: Endpoint

    @property
    def name(self) -> str:
        return f"openai {self.endpoint.value}"

    @property
    def any_slot(self) -> bool:
        # llama-server runs an embedding on any idle slot: it does not read id_slot for them.
        return self.endpoint is Endpoint.EMBEDDINGS

    def check(self, body: Any, grant_tokens: int) -> None:
        bad = check_body(self.endpoint, body, grant_tokens)
        if bad is not None:
            raise Bad(bad.param, bad.message)

    def forward(self, body: dict[str, Any]) -> Forward:
        asked = 0 if self.endpoint is Endpoint.EMBEDDINGS else asked_tokens(body)
        return Forward(self.endpoint.value, body, _COUNTING[self.endpoint], asked)

    def pin(self, fwd: Forward, slot: int, n_predict: int | None) -> dict[str, Any]:
        embeds = self.endpoint is Endpoint.EMBEDDINGS
        return cap_body(fwd.body, slot, None if embeds else n_predict)

    def shaper(self, note: Annotate) -> LastEvent:
        return LastEvent(note, _finishes)

    def over_grant(self, over: OverGrant) -> Reply:
        param = _PROMPT_PARAM.get(self.endpoint, "input")
        return Reply(400, over_grant_body(over, param), {SHOULD_RETRY_HEADER: "false"})

    def stream_error(self, kind: str, message: str, extra: dict[str, Any]) -> bytes:
        # OpenAI's clients raise an event holding `error` (openai-python: APIError).
        code = extra.get("reason", extra.get("code"))
        body = error_body(message, kind, code)
        if "reason" in extra:
            body["continuum"] = {"error": kind, **extra}
        return sse(body)
