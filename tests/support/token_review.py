"""Shared by the tests: moved from tests.unit.engine.test_token_review_lanes."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from continuum_operator.door.token_review import (
    claimed_account,
)
from tests.support.fake_apiserver import review_answer, reviewed_token

AUDIENCE = "continuum.dev/engine/ml/coder"


def jwt(sub: str, *, nonce: str = "", exp: float | None = None) -> str:
    """A token shaped as a service account's (its signature is not read here)."""

    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

    claims: dict[str, Any] = {"sub": sub, "aud": [AUDIENCE], "jti": nonce}
    if exp is not None:
        claims["exp"] = exp
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


MIRA_SUB = "system:serviceaccount:minds:mira"


class Api:
    """The API server's TokenReview: accepts the tokens in `good`; strangers' reviews wait
    `stranger_seconds` (a busy API server)."""

    def __init__(self, *good: str, stranger_seconds: float = 0.0) -> None:
        self.good = set(good)
        self.stranger_seconds = stranger_seconds
        self.calls: list[str] = []

    async def create(self, review: dict[str, Any], *, seconds: float | None = None) -> Any:
        token, _ = reviewed_token(review)
        self.calls.append(token)
        ok = token in self.good
        if not ok:
            await asyncio.sleep(self.stranger_seconds)
        claimed = claimed_account(token)
        name = f"system:serviceaccount:{claimed.namespace}:{claimed.name}" if claimed else MIRA_SUB
        return review_answer(name if ok else None, [AUDIENCE])
