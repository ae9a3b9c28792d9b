"""The turn client: how a mind takes a turn on an engine through its gateway (docs/gateway.md).

    async with turn("http://engine:8080", "minds/mira", deadline_seconds=1500) as t:
        reply = await t.complete({"prompt": "...", "n_predict": 128})

Entering waits, with the gateway's reason, while the grant is queued or the engine relaunches,
and no longer than the turn deadline. It never waits while the mind's own grant is being
reclaimed: that ends the turn at once (`TurnCut`), which is what keeps a reclaim from waiting
on the turn it blocks (docs/design.md rule 7). Every wait is recorded on the turn with its reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MIND_HEADER = "X-Continuum-Mind"
TURN_HEADER = "X-Continuum-Turn"


class TurnError(Exception):
    """A turn that could not run, or was ended. Subclasses say why."""

    def __init__(self, mind: str, reason: str, message: str) -> None:
        self.mind = mind
        self.reason = reason
        super().__init__(f"{mind}: {message}")


class TurnCut(TurnError):
    """The mind's grant is being reclaimed: the turn ended at once; she is requeued."""


class TurnDeadline(TurnError):
    """The turn waited up to its deadline without a grant."""


class ContextTooLarge(TurnError):
    """The mind needs more than a slot holds; waiting would not help."""


class TurnRefused(TurnError):
    """The gateway refused the mind (not one of this engine's), or answered unexpectedly."""


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str
    seconds: float


@dataclass(slots=True)
class Turn:
    mind: str
    turn_id: str
    slot: int
    tokens: int
    waits: list[Wait] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    _base: str = ""
    _auth: dict[str, str] = field(default_factory=dict)
    #: The gateway's note on the last generation (slot, grant, cut-off): docs/gateway.md.
    note: dict[str, Any] = field(default_factory=dict)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One llama-server `/completion` inside the turn; TurnCut if the grant is reclaimed."""
        assert self._session is not None
        async with self._session.post(
            f"{self._base}/completion",
            json=body,
            headers={MIND_HEADER: self.mind, TURN_HEADER: self.turn_id, **self._auth},
        ) as resp:
            payload = await _json(resp)
            if resp.status == 409:
                raise TurnCut(self.mind, str(payload.get("reason", "")), _cut_message(payload))
            if resp.status != 200:
                raise TurnRefused(
                    self.mind,
                    str(payload.get("error", resp.status)),
                    f"completion refused with {resp.status}: {payload}",
                )
            return payload

    async def stream_chat(self, body: dict[str, Any]) -> AsyncIterator[str]:
        """A streamed `/v1/chat/completions` inside the turn: the text of each chunk.

        The gateway's note on the last chunk is kept in `note`; TurnCut if the grant is
        reclaimed, before or during the stream.
        """
        assert self._session is not None
        headers = {MIND_HEADER: self.mind, TURN_HEADER: self.turn_id, **self._auth}
        async with self._session.post(
            f"{self._base}/v1/chat/completions", json={**body, "stream": True}, headers=headers
        ) as resp:
            if resp.status != 200:
                payload = await _json(resp)
                error = payload.get("error")
                native = error.get("continuum", {}) if isinstance(error, dict) else payload
                if resp.status == 409:
                    raise TurnCut(self.mind, str(native.get("reason", "")), _cut_message(native))
                raise TurnRefused(
                    self.mind, str(native.get("error", resp.status)), f"{resp.status}: {payload}"
                )
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[len(b"data: ") :])
                if not isinstance(event, dict):
                    continue
                if isinstance(event.get("error"), dict):
                    native = event.get("continuum") or {}
                    raise TurnCut(self.mind, str(native.get("reason", "")), _cut_message(native))
                if isinstance(event.get("continuum"), dict):
                    self.note = event["continuum"]
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield str(text)


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = await resp.json(content_type=None)
    except (aiohttp.ContentTypeError, ValueError):
        return {"error": (await resp.text())[:200]}
    return data if isinstance(data, dict) else {"value": data}


def _cut_message(payload: dict[str, Any]) -> str:
    by = f" by {payload['by']}" if payload.get("by") else ""
    return f"turn ended: the grant is being reclaimed ({payload.get('reason', 'unknown')}{by})"


@asynccontextmanager
async def turn(
    gateway: str,
    mind: str,
    *,
    deadline_seconds: float = 1500.0,
    context_tokens: int | None = None,
    session: aiohttp.ClientSession | None = None,
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    token: str | None = None,
) -> AsyncIterator[Turn]:
    """Open a turn for `mind`, waiting (with reasons) at most `deadline_seconds`.

    `token`: the mind's service account token, for a gateway that reviews tokens.
    """
    own = session is None
    # No total timeout (aiohttp's default is 300 s): a reply may stream for longer on a slow
    # engine; opening the turn is bounded by its deadline instead (`_open`).
    http = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)
    )
    base = gateway.rstrip("/")
    try:
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        t = await _open(
            http, base, mind, deadline_seconds, context_tokens, poll_seconds, clock, auth
        )
        try:
            yield t
        finally:
            async with http.delete(
                f"{base}/v1/turns/{t.turn_id}", headers={MIND_HEADER: mind, **auth}
            ):
                pass
    finally:
        if own:
            await http.close()


async def _open(
    http: aiohttp.ClientSession,
    base: str,
    mind: str,
    deadline_seconds: float,
    context_tokens: int | None,
    poll_seconds: float,
    clock: Callable[[], float],
    auth: dict[str, str],
) -> Turn:
    started = clock()
    deadline = started + deadline_seconds
    waits: list[Wait] = []
    body = {} if context_tokens is None else {"contextTokens": context_tokens}
    reason, since = "", started
    while True:
        headers = {MIND_HEADER: mind, **auth}
        # Each try bounded by what is left of the deadline: a gateway that accepts and never
        # answers must not hold the mind past it.
        left = aiohttp.ClientTimeout(total=max(0.1, deadline - clock()))
        try:
            async with http.post(
                f"{base}/v1/turns", json=body, headers=headers, timeout=left
            ) as resp:
                payload = await _json(resp)
                retry_after = resp.headers.get("Retry-After")
                status = resp.status
        except TimeoutError:
            raise TurnDeadline(
                mind,
                reason or "NoAnswer",
                f"the gateway did not answer within the turn deadline of {deadline_seconds:.0f} s",
            ) from None
        now = clock()
        if reason and (status not in (429, 503) or payload.get("reason") != reason):
            waits.append(Wait(reason, now - since))
            reason = ""
        if status == 201:
            return Turn(
                mind,
                str(payload["turn"]),
                int(payload["slot"]),
                int(payload["tokens"]),
                waits,
                http,
                base,
                auth,
            )
        if status == 409:
            raise TurnCut(mind, str(payload.get("reason", "")), _cut_message(payload))
        if status == 413:
            raise ContextTooLarge(
                mind,
                "ContextTooLarge",
                f"needs {payload.get('askedTokens')} tokens, a slot holds "
                f"{payload.get('slotTokens')}; ask for a larger spec.contextTokensPerMind",
            )
        if status not in (429, 503):
            raise TurnRefused(
                mind, str(payload.get("error", status)), f"gateway answered {status}: {payload}"
            )
        if not reason:
            reason, since = str(payload.get("reason", payload.get("error", "Queued"))), now
        if now >= deadline:
            waits.append(Wait(reason, now - since))
            raise TurnDeadline(
                mind,
                reason,
                f"no grant within the turn deadline of {deadline_seconds:.0f} s "
                f"(waiting: {reason})",
            )
        hint = float(retry_after) if retry_after and retry_after.isdigit() else poll_seconds
        await asyncio.sleep(max(0.0, min(hint, poll_seconds, deadline - now)))
