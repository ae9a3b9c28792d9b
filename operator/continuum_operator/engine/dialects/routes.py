"""Every route llama-server serves, and what the gateway does with it: served, filtered or
refused, and why (docs/gateway.md, "Every route"). Pure: the gateway (`engine.llama_routes`)
does the I/O.

A route this table does not name is refused: a route llama-server learns tomorrow does not
pass by default, as a body field does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from continuum_operator.engine.admission import Admission, Answer, Refusal
from continuum_operator.engine.dialects.anthropic import Messages
from continuum_operator.engine.dialects.base import Dialect
from continuum_operator.engine.dialects.native import Native
from continuum_operator.engine.dialects.openai import OpenAI
from continuum_operator.engine.openai_api import Endpoint


class Decision(StrEnum):
    SERVED = "served"
    FILTERED = "filtered"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    decision: Decision
    why: str


_SLOT = "takes her slot: pinned to it, generation capped to her grant"
_TWIN = "the same handler as its /v1 twin in llama-server: served as that twin"
_FREE = "takes no slot: served to a mind of this engine, its body and her rate bounded"

_ANY_SLOT = "runs on any idle slot, not hers (it would overwrite another mind's context)"
_BY_ID = "it reaches a generation by its id, whoever's it is"
_ROUTER = "the router's model management is the operator's (the engine runs one model)"

#: Each route of llama-server (the vendored tools/server/server.cpp of tools/versions'
#: llama-cpp-python) and the gateway's decision.
ROUTES: tuple[Route, ...] = (
    Route("POST", "/completion", Decision.SERVED, _SLOT),
    Route("POST", "/completions", Decision.SERVED, "llama-server's /completion: served as it"),
    Route("POST", "/v1/completions", Decision.SERVED, _SLOT),
    Route("POST", "/chat/completions", Decision.SERVED, _TWIN),
    Route("POST", "/v1/chat/completions", Decision.SERVED, _SLOT),
    Route(
        "POST",
        "/v1/messages",
        Decision.SERVED,
        _SLOT + "; translated to a chat (llama-server's own drops id_slot)",
    ),
    Route("POST", "/v1/responses", Decision.SERVED, _SLOT + "; translated to a chat"),
    Route("POST", "/responses", Decision.SERVED, _TWIN),
    Route(
        "POST",
        "/v1/embeddings",
        Decision.SERVED,
        "on an engine of one slot only (llama-server embeds on any idle slot)",
    ),
    Route("GET", "/v1/models", Decision.SERVED, "the one model, to a mind of this engine"),
    Route("GET", "/models", Decision.SERVED, _TWIN),
    Route("GET", "/health", Decision.SERVED, "the gateway's readiness (grant table and engine)"),
    Route("GET", "/v1/health", Decision.SERVED, "as /health"),
    Route("POST", "/tokenize", Decision.SERVED, _FREE),
    Route("POST", "/detokenize", Decision.SERVED, _FREE),
    Route("POST", "/apply-template", Decision.SERVED, _FREE),
    Route("POST", "/chat/completions/input_tokens", Decision.SERVED, _FREE),
    Route("POST", "/v1/chat/completions/input_tokens", Decision.SERVED, _FREE),
    Route("POST", "/v1/messages/count_tokens", Decision.SERVED, _FREE + "; counted as sent"),
    Route("POST", "/v1/responses/input_tokens", Decision.SERVED, _FREE + "; counted as sent"),
    Route("POST", "/responses/input_tokens", Decision.SERVED, _TWIN),
    Route(
        "GET",
        "/props",
        Decision.FILTERED,
        "what concerns her alone: the model's template and tokens, her grant as n_ctx; "
        "not the engine's paths, slots or settings",
    ),
    Route(
        "GET",
        "/slots",
        Decision.FILTERED,
        "her own slot at most (the others hold other minds' contexts)",
    ),
    Route("GET", "/metrics", Decision.REFUSED, "the operator's: served on the admin port"),
    Route("POST", "/props", Decision.REFUSED, "it changes the engine's settings for every mind"),
    Route(
        "POST",
        "/slots/{id}",
        Decision.REFUSED,
        "save, restore and erase reach a slot's cache (the gateway erases hers itself)",
    ),
    Route("GET", "/lora-adapters", Decision.REFUSED, "adapters are the engine's"),
    Route("POST", "/lora-adapters", Decision.REFUSED, "adapters are the engine's, for every mind"),
    Route(
        "POST",
        "/infill",
        Decision.REFUSED,
        "its extra context (input_extra) is not counted against her grant",
    ),
    Route("POST", "/embedding", Decision.REFUSED, _ANY_SLOT + ": use /v1/embeddings"),
    Route("POST", "/embeddings", Decision.REFUSED, _ANY_SLOT + ": use /v1/embeddings"),
    Route("POST", "/rerank", Decision.REFUSED, _ANY_SLOT),
    Route("POST", "/reranking", Decision.REFUSED, _ANY_SLOT),
    Route("POST", "/v1/rerank", Decision.REFUSED, _ANY_SLOT),
    Route("POST", "/v1/reranking", Decision.REFUSED, _ANY_SLOT),
    Route(
        "POST",
        "/v1/audio/transcriptions",
        Decision.REFUSED,
        "audio is counted by no bound of its bytes",
    ),
    Route("POST", "/audio/transcriptions", Decision.REFUSED, "audio is counted by no bound"),
    Route("POST", "/v1/chat/completions/control", Decision.REFUSED, _BY_ID),
    Route("GET", "/v1/stream", Decision.REFUSED, _BY_ID),
    Route("DELETE", "/v1/stream", Decision.REFUSED, _BY_ID),
    Route("POST", "/v1/streams/lookup", Decision.REFUSED, _BY_ID),
    Route("GET", "/cors-proxy", Decision.REFUSED, "it fetches other servers from the engine"),
    Route("POST", "/cors-proxy", Decision.REFUSED, "it fetches other servers from the engine"),
    Route("GET", "/tools", Decision.REFUSED, "it runs tools on the engine's host"),
    Route("POST", "/tools", Decision.REFUSED, "it runs tools on the engine's host"),
    Route("POST", "/models", Decision.REFUSED, _ROUTER),
    Route("DELETE", "/models", Decision.REFUSED, _ROUTER),
    Route("POST", "/models/load", Decision.REFUSED, _ROUTER),
    Route("POST", "/models/unload", Decision.REFUSED, _ROUTER),
    Route("GET", "/models/sse", Decision.REFUSED, _ROUTER),
    Route("GET", "/", Decision.REFUSED, "llama-server's web page is the operator's"),
)

REFUSED: Mapping[tuple[str, str], Route] = {
    (r.method, r.path): r for r in ROUTES if r.decision is Decision.REFUSED
}

_ANTHROPIC = Messages()
_OPENAI = OpenAI(Endpoint.CHAT)
_NATIVE = Native()


def shape_for(path: str) -> Dialect:
    """The dialect whose error shape a route's refusal is said in."""
    if path.startswith("/v1/messages"):
        return _ANTHROPIC
    if path.startswith(("/v1/", "/chat/", "/responses")):
        return _OPENAI
    return _NATIVE


def not_served(method: str, path: str) -> Admission:
    """The refusal of a route the gateway does not serve: named where the table names it
    (403, why), else 404 (no route of the gateway's: refused by default)."""
    route = REFUSED.get((method, path))
    if route is None and path.startswith("/slots/"):
        route = REFUSED[("POST", "/slots/{id}")]
    if route is not None:
        message = f"{method} {path}: refused by the gateway ({route.why})"
        return Admission(
            Answer.REFUSE, 403, {"error": "not_served", "message": message}, Refusal.NOT_SERVED
        )
    message = (
        f"{method} {path}: not a route of this gateway (a llama-server route is served only "
        "where docs/gateway.md lists it)"
    )
    return Admission(
        Answer.REFUSE, 404, {"error": "not_served", "message": message}, Refusal.NOT_SERVED
    )


@dataclass(slots=True)
class RateBucket:
    """A token bucket per mind: `per_second` requests, bursts of `burst`."""

    per_second: float
    burst: int
    clock: Callable[[], float]
    _left: dict[str, tuple[float, float]] = field(default_factory=dict)

    def wait(self, key: str) -> int:
        """0 if `key` may go now (and spends one); else the whole seconds until it may."""
        now = self.clock()
        left, then = self._left.get(key, (float(self.burst), now))
        left = min(float(self.burst), left + (now - then) * self.per_second)
        if left >= 1.0:
            self._left[key] = (left - 1.0, now)
            return 0
        self._left[key] = (left, now)
        return max(1, math.ceil((1.0 - left) / self.per_second))


def rate_limited(wait: int) -> Admission:
    message = f"too many requests of this kind: send it again in {wait} s"
    return Admission(
        Answer.REFUSE,
        429,
        {"error": Refusal.RATE_LIMITED.value, "message": message},
        Refusal.RATE_LIMITED,
        retry_after=wait,
    )


#: The fields of `/props` that concern her alone: the model's template and special tokens.
PROPS_KEPT = ("chat_template", "bos_token", "eos_token", "modalities", "build_info", "model_alias")
#: The fields of a slot of `/slots` that say its state, not what it holds.
SLOT_STATE = ("id", "id_task", "n_ctx", "is_processing", "speculative")


def her_props(props: Any, grant_tokens: int | None, slot: int | None) -> dict[str, Any]:
    """llama-server's `/props` as she may see it: the model's, and her grant as `n_ctx`."""
    source = props if isinstance(props, dict) else {}
    out = {k: source[k] for k in PROPS_KEPT if k in source}
    settings = source.get("default_generation_settings")
    params = settings.get("params") if isinstance(settings, dict) else None
    out["default_generation_settings"] = {"n_ctx": grant_tokens, "params": params or {}}
    out["total_slots"] = 1
    out["continuum"] = {"slot": slot, "grantTokens": grant_tokens}
    return out


def her_slots(slots: Any, slot: int | None, hers: bool) -> list[dict[str, Any]]:
    """llama-server's `/slots` as she may see it: her own slot at most; what it holds only
    when it holds hers (`hers`: not erased since another mind had it)."""
    if slot is None or not isinstance(slots, list):
        return []
    mine = [s for s in slots if isinstance(s, dict) and s.get("id") == slot]
    if hers:
        return mine
    return [{k: s[k] for k in SLOT_STATE if k in s} for s in mine]
