"""OpenAI's API at the gateway's door: which requests may pass, and how refusals are worded.

The gateway (`engine.gateway`) serves `/v1/chat/completions`, `/v1/completions` and
`/v1/embeddings` by passing them to llama-server's own OpenAI-compatible endpoints, with the
grant enforced as on `/completion` (docs/gateway.md, "OpenAI's API"). What may pass is decided
here, pure, so each rule is shown alone:

- `check_body`: a request body against its endpoint's allow-list. A field that could leave the
  mind's slot or grant (`n` > 1 and `n_cmpl`, which run on other minds' idle slots and overwrite
  their KV cache; `n_probs` up to the vocabulary; `lora`; `response_fields`; several prompts or
  inputs, each a task of its own slot) is refused with the field named, and so is any field the
  list does not know: an allow-list, so a field llama-server learns tomorrow does not pass by
  default.
- `check_native`: the same for llama-server's own `/completion`, with its own names.
- `cap_body`: the body as forwarded: pinned to the slot, generation capped.
- `error_body` / `refusal_body`: OpenAI's error shape (`{"error": {message, type, param,
  code}}`), which its clients read; the gateway's own answer rides along in it, under
  `continuum`.

Neighbours: `engine.admission` (the grant decisions these answers carry), `engine.gateway`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from continuum_operator.door.openai_errors import error_body, error_type
from continuum_operator.engine.admission import SPECIAL_TOKEN_MARGIN, Admission, OverGrant

__all__ = [
    "SAMPLING",
    "Endpoint",
    "FieldError",
    "cap_body",
    "check_body",
    "check_native",
    "error_body",
    "error_type",
    "over_grant_body",
    "prompt_bound",
    "refusal_body",
]


class Endpoint(StrEnum):
    """An OpenAI endpoint the gateway serves, by its path (the same path on llama-server)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"


#: Sampling and output fields llama-server reads that stay inside the slot and the grant.
SAMPLING = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "repeat_last_n",
        "logit_bias",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "xtc_probability",
        "xtc_threshold",
        "top_n_sigma",
        "dynatemp_range",
        "dynatemp_exponent",
        "samplers",
        "grammar",
        "json_schema",
        "ignore_eos",
        "cache_prompt",
        "timings_per_token",
    }
)

#: Fields of every generating endpoint: the model (any name: one engine serves one model),
#: streaming, the length (capped) and who asks.
_GENERATING = SAMPLING | {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "user",
    "id_slot",  # overwritten with her slot (docs/gateway.md)
}

ALLOWED: Mapping[Endpoint, frozenset[str]] = {
    Endpoint.CHAT: _GENERATING
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "reasoning_format",
        "metadata",
        "store",
    },
    Endpoint.COMPLETIONS: _GENERATING | {"prompt", "logprobs", "echo", "best_of"},
    Endpoint.EMBEDDINGS: frozenset({"model", "input", "encoding_format", "user"}),
}

#: llama-server's native `/completion` inside a turn (docs/gateway.md): its own names for the
#: length (`n_predict`, capped) and the probabilities (`n_probs`, bounded), `n`/`n_cmpl` only 1.
NATIVE_ALLOWED = SAMPLING | {
    "prompt",
    "n_predict",
    "stream",
    "id_slot",  # overwritten with her slot
    "n",
    "n_cmpl",
    "n_probs",
    "post_sampling_probs",
    "return_tokens",
    "t_max_predict_ms",
}

#: Why a field llama-server would take is refused: what it would do to other minds or the grant.
REFUSED_WHY: Mapping[str, str] = {
    "n_cmpl": "it runs completions on other slots, overwriting other minds' KV cache",
    "n_probs": "it asks for probabilities up to the whole vocabulary; use logprobs/top_logprobs",
    "lora": "adapters are the engine's, not a request's",
    "response_fields": "it reshapes the reply past what OpenAI's clients read",
    "n_predict": "use max_tokens (the gateway caps it to the grant)",
    "n_keep": "the context is the grant's; nothing is shifted out of it",
    "n_discard": "the context is the grant's; nothing is shifted out of it",
    "n_indent": "not part of OpenAI's API",
    "post_sampling_probs": "not part of OpenAI's API",
}

#: OpenAI's top_logprobs maximum (chat), and logprobs maximum (completions).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


@dataclass(frozen=True, slots=True)
class FieldError:
    """A request field the gateway does not pass, and what to do instead."""

    param: str
    message: str

    def body(self) -> dict[str, Any]:
        return error_body(
            self.message, "invalid_request_error", "unsupported_parameter", self.param
        )


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(name, f"{name}: expected an integer, got {value!r}")
    return value


class _Bad(Exception):
    def __init__(self, param: str, message: str) -> None:
        self.error = FieldError(param, message)


def _listed_only(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Every field of `body` on the allow-list: the first one not, refused with why."""
    for name in sorted(body):
        if name not in allowed:
            why = REFUSED_WHY.get(name, "not served by this gateway")
            raise _Bad(name, f"{name}: not accepted ({why})")


def _one_prompt(prompt: Any, name: str, max_pieces: int) -> None:
    """One prompt: a string, a list of token ids, or a list holding one of those."""
    several = f"{name}: one {name} per request (several would run on several slots)"
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise _Bad(name, f"{name}: a string or a list of token ids")
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        _one_prompt(prompt[0], name, max_pieces)
        return
    if any(isinstance(p, str) for p in prompt):
        raise _Bad(name, several)
    if any(isinstance(p, list) for p in prompt):
        raise _Bad(name, several)
    if any(isinstance(p, bool) or not isinstance(p, int) for p in prompt):
        raise _Bad(name, f"{name}: a list of token ids (integers)")
    if len(prompt) > max_pieces:
        raise _Bad(name, f"{name}: {len(prompt)} tokens, more than the grant's {max_pieces}")


def _messages(messages: Any, max_pieces: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise _Bad("messages", "messages: a non-empty list of {role, content}")
    parts = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _Bad(f"messages[{i}]", f"messages[{i}]: an object with role and content")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                parts += 1
                if not isinstance(part, dict) or part.get("type") != "text":
                    # An image or audio part is counted by no bound of bytes: not passed.
                    raise _Bad(
                        f"messages[{i}].content[{j}]",
                        f"messages[{i}].content[{j}]: only text parts are served",
                    )
    if len(messages) + parts > max_pieces:
        raise _Bad("messages", f"messages: more pieces than the grant's {max_pieces} tokens")


def check_body(endpoint: Endpoint, body: Any, grant_tokens: int) -> FieldError | None:
    """None if `body` may be forwarded to `endpoint`; else the first field refused.

    `grant_tokens` bounds the pieces of a prompt: a list longer than the grant cannot fit,
    and would otherwise cost the gateway work per piece before the grant is checked.
    """
    if not isinstance(body, dict):
        return FieldError("", "the body is not a JSON object")
    try:
        _listed_only(body, ALLOWED[endpoint])
        n = _int_field(body, "n")
        if n is not None and n != 1:
            raise _Bad("n", "n: only 1 (more choices would run on other minds' slots)")
        best_of = _int_field(body, "best_of")
        if best_of is not None and best_of != 1:
            raise _Bad("best_of", "best_of: only 1 (more would run on other minds' slots)")
        if body.get("echo"):
            raise _Bad("echo", "echo: not served (llama-server does not echo prompts)")
        if endpoint is Endpoint.CHAT:
            _messages(body.get("messages"), grant_tokens)
            top = _int_field(body, "top_logprobs")
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise _Bad("top_logprobs", f"top_logprobs: 0 to {MAX_TOP_LOGPROBS}")
            if "logprobs" in body and not isinstance(body["logprobs"], bool | None):
                raise _Bad("logprobs", "logprobs: true or false")
        elif endpoint is Endpoint.COMPLETIONS:
            _one_prompt(body.get("prompt"), "prompt", grant_tokens)
            logprobs = _int_field(body, "logprobs")
            if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
                raise _Bad("logprobs", f"logprobs: 0 to {MAX_COMPLETION_LOGPROBS}")
        else:
            _one_prompt(body.get("input"), "input", grant_tokens)
        for name in ("max_tokens", "max_completion_tokens"):
            value = _int_field(body, name)
            if value is not None and value < 1:
                raise _Bad(name, f"{name}: a positive integer")
    except _Bad as bad:
        return bad.error
    return None


def check_native(body: Any) -> FieldError | None:
    """None if `body` may be forwarded to llama-server's `/completion`; else the first field
    refused. The same allow-list rule as `check_body`: llama-server reads `n_cmpl` (and `n`)
    on `/completion` too and runs the extra completions on other minds' idle slots, and
    `n_probs` up to the vocabulary is a reply of vocabulary x tokens entries the gateway would
    hold in memory."""
    if not isinstance(body, dict):
        return FieldError("", "the body is not a JSON object")
    try:
        _listed_only(body, NATIVE_ALLOWED)
        for name in ("n", "n_cmpl"):
            n = _int_field(body, name)
            if n is not None and n != 1:
                raise _Bad(name, f"{name}: only 1 (more would run on other minds' slots)")
        n_probs = _int_field(body, "n_probs")
        if n_probs is not None and not 0 <= n_probs <= MAX_TOP_LOGPROBS:
            raise _Bad("n_probs", f"n_probs: 0 to {MAX_TOP_LOGPROBS}")
    except _Bad as bad:
        return bad.error
    return None


def asked_tokens(body: Mapping[str, Any]) -> int | None:
    """The generation the request asks for (None: as much as fits)."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_bound(text: str, pieces: int = 1) -> int:
    """An upper bound of a text's tokens without tokenizing (as `admission.prompt_token_bound`)."""
    return len(text.encode()) + SPECIAL_TOKEN_MARGIN * pieces


def cap_body(body: dict[str, Any], slot: int, n_predict: int | None) -> dict[str, Any]:
    """The body as forwarded: pinned to `slot`, generating at most `n_predict` tokens."""
    out = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    out["id_slot"] = slot
    if n_predict is not None:
        # llama-server reads n_predict first, max_tokens else: both say the cap.
        out["n_predict"] = n_predict
        out["max_tokens"] = n_predict
    return out


def refusal_body(adm: Admission) -> dict[str, Any]:
    """A refusal of the grant protocol in OpenAI's shape; its own answer under `continuum`."""
    native = adm.body
    reason = native.get("reason")
    code = native.get("error")
    message = str(native.get("message") or "")
    if not message:
        parts = [str(code)]
        if reason:
            parts.append(f"reason {reason}")
        if native.get("by"):
            parts.append(f"by {native['by']}")
        if native.get("position"):
            parts.append(f"place in line {native['position']}")
        message = ", ".join(parts)
    out = error_body(message, error_type(adm.status), str(code) if code else None)
    out["error"]["continuum"] = native  # where OpenAI's clients keep the error (err.body)
    return out


def over_grant_body(over: OverGrant, param: str) -> dict[str, Any]:
    """The prompt alone fills the grant: OpenAI's `context_length_exceeded`."""
    out = error_body(
        f"this model's context for you is {over.grant_tokens} tokens (your grant); the "
        f"prompt takes {over.prompt_tokens}: shorten it",
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )
    out["error"]["continuum"] = over.body()
    return out
