"""A fake API server answering TokenReviews and the JWTs it issues, for the tests of token
review and its lanes."""

from __future__ import annotations

import base64
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

from continuum_operator.engine.token_review import (
    claimed_account,
)

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
    `stranger_seconds` (a busy API server), and `hold` stops every review until set."""

    def __init__(self, *good: str, stranger_seconds: float = 0.0) -> None:
        self.good = set(good)
        self.stranger_seconds = stranger_seconds
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def create_token_review(self, review: Any, _request_timeout: Any = None) -> Any:
        token = review.spec.token
        with self.lock:
            self.calls.append(token)
        ok = token in self.good
        if not ok:
            time.sleep(self.stranger_seconds)
        claimed = claimed_account(token)
        name = f"system:serviceaccount:{claimed.namespace}:{claimed.name}" if claimed else MIRA_SUB
        user = SimpleNamespace(username=name) if ok else None
        return SimpleNamespace(
            status=SimpleNamespace(authenticated=ok, user=user, audiences=[AUDIENCE] if ok else [])
        )
