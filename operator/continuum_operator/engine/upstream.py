"""How llama-server failed a call of the gateway's (`engine.gateway`, `engine.llama_routes`)."""

from __future__ import annotations

from typing import Any


class UpstreamDown(Exception):
    """llama-server did not answer (restarting, crashed)."""


class BadUpstreamRequest(Exception):
    """llama-server refused the request itself (a malformed chat, say): its answer is passed on."""

    def __init__(self, status: int, payload: Any) -> None:
        self.status = status
        self.payload = payload
        super().__init__(f"llama-server answered {status}")
