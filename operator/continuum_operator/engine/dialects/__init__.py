"""The APIs the gateway speaks, one module each, behind one seam (`base.Dialect`).

`native` (llama-server's `/completion`), `openai` (Chat Completions, Completions,
Embeddings), `anthropic` (Messages) and `responses` (OpenAI's Responses). `DOORS` maps each
generating route the gateway serves to its dialect (docs/gateway.md, "Every route").
"""

from __future__ import annotations

from collections.abc import Mapping

from continuum_operator.engine.dialects.anthropic import Messages
from continuum_operator.engine.dialects.base import (
    SHOULD_RETRY_HEADER,
    Annotate,
    Bad,
    Counting,
    Dialect,
    Forward,
    Reply,
    Shaper,
)
from continuum_operator.engine.dialects.native import Native
from continuum_operator.engine.dialects.openai import OpenAI
from continuum_operator.engine.dialects.responses import Responses
from continuum_operator.engine.openai_api import Endpoint

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DOORS",
    "EMBEDDINGS",
    "MESSAGES",
    "NATIVE",
    "RESPONSES",
    "SHOULD_RETRY_HEADER",
    "Annotate",
    "Bad",
    "Counting",
    "Dialect",
    "Forward",
    "Reply",
    "Shaper",
]

NATIVE = Native()
CHAT = OpenAI(Endpoint.CHAT)
COMPLETIONS = OpenAI(Endpoint.COMPLETIONS)
EMBEDDINGS = OpenAI(Endpoint.EMBEDDINGS)
MESSAGES = Messages()
RESPONSES = Responses()

#: Each generating route of the gateway, and the dialect it is spoken in: llama-server's names
#: for them, with and without `/v1` as it has them (its `/completions` is its native
#: `/completion`; its `/embeddings`, native too, is refused: `dialects.routes`).
DOORS: Mapping[str, Dialect] = {
    "/completion": NATIVE,
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completions": NATIVE,  # llama-server's /completion under another name
    "/v1/embeddings": EMBEDDINGS,
    "/v1/messages": MESSAGES,
    "/v1/responses": RESPONSES,
    "/responses": RESPONSES,
}
