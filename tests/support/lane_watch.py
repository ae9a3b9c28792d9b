"""An EmbedLane on the fake API server, for the tests of the lane's watch."""

from __future__ import annotations

from typing import Any

LANES = "embedlanes"


def lane(context_tokens: int, max_context_tokens: Any = 4096) -> dict[str, Any]:
    placement = {"verdict": "Fits", "contextTokens": context_tokens, "residence": "host"}
    return {
        "kind": "EmbedLane",
        "metadata": {"name": "docs"},
        "spec": {"maxContextTokens": max_context_tokens},
        "status": {"placement": placement},
    }
