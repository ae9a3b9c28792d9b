"""OpenAI's error shape, as a door answers in it: the engine gateway's OpenAI routes
(`engine.openai_api`) and the embed lane's `/v1/embeddings` (`embed.runtime`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["error_body", "error_type"]


def error_body(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


#: OpenAI error type per status, for answers of the grant protocol and the lanes'.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def error_type(status: int) -> str:
    """OpenAI's error `type` of an answer of this status (the embed lane's answers too)."""
    return _TYPES.get(status, "api_error")
