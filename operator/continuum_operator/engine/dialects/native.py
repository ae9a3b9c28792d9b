"""llama-server's own `/completion` inside a turn (docs/gateway.md, "Inside a turn"): its own
names for the length (`n_predict`, capped) and the probabilities (`n_probs`, bounded), its
own answers, and the grant protocol's answers as they are (`{"error": ..., "reason": ...}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from continuum_operator.engine.admission import (
    Admission,
    OverGrant,
    Refusal,
    prompt_token_bound,
)
from continuum_operator.engine.dialects.base import (
    Annotate,
    Bad,
    Counting,
    Forward,
    LastEvent,
    PassThrough,
    Reply,
    int_field,
    sse,
)
from continuum_operator.engine.openai_api import check_native

PATH = "/completion"


def _stops(line: bytes) -> bool:
    return b'"stop":true' in line.replace(b" ", b"")


@dataclass(frozen=True, slots=True)
class Native(PassThrough):
    name: str = "native /completion"
    any_slot: bool = False

    def check(self, body: Any, grant_tokens: int) -> None:
        bad = check_native(body)
        if bad is not None:
            raise Bad(bad.param, bad.message)
        prompt = body.get("prompt")
        if prompt_token_bound(prompt) is None:
            raise Bad("prompt", "prompt: one prompt (a string, or a list of tokens and strings)")
        if isinstance(prompt, list) and len(prompt) > grant_tokens:
            raise Bad(
                "prompt",
                f"prompt: {len(prompt)} pieces, more than the grant's {grant_tokens} tokens",
            )
        try:
            int_field(body, "n_predict")
        except Bad:
            raise Bad("n_predict", "n_predict: an integer") from None

    def forward(self, body: dict[str, Any]) -> Forward:
        asked = body.get("n_predict")
        return Forward(PATH, body, Counting.NATIVE, asked if isinstance(asked, int) else None)

    def pin(self, fwd: Forward, slot: int, n_predict: int | None) -> dict[str, Any]:
        out = dict(fwd.body)
        out["id_slot"] = slot
        out["n_predict"] = n_predict
        return out

    def shaper(self, note: Annotate) -> LastEvent:
        return LastEvent(note, _stops)

    def refusal(self, adm: Admission) -> Reply:
        headers = {"Retry-After": str(adm.retry_after)} if adm.retry_after else {}
        return Reply(adm.status, adm.body, headers)

    def bad_request(self, param: str, message: str) -> Reply:
        return Reply(400, {"error": Refusal.BAD_REQUEST.value, "message": message})

    def over_grant(self, over: OverGrant) -> Reply:
        return Reply(413, over.body())

    def stream_error(self, kind: str, message: str, extra: dict[str, Any]) -> bytes:
        if "reason" in extra:  # a cut: its reason, as the turn protocol's answers say it
            event = {"type": kind, "reason": extra["reason"]}
            if "message" in extra:  # the watchdog's cut: what to change
                event["message"] = extra["message"]
            return sse({"error": event})
        return sse({"error": {"code": extra.get("code"), "message": message, "type": kind}})
