"""Who a bearer token speaks for: a TokenReview with the API server, for one audience.

The engine's gateway (a mind's token, the engine's audience) and an EmbedLane's runtime (a
caller's token, the lane's audience) both open their door with `TokenReviewer`. Anyone who
reaches the port may send a token, so what a stranger's tokens cost is bounded, and they
cannot keep a mind waiting:

- **Two lanes.** A token whose claims name an account the door knows (a Mind in the grant
  table: `Caller.known`) is reviewed in the minds' lane, every other in the strangers' lane;
  each lane has reviews in flight of its own (`REVIEWS_PER_LANE`), so a mind's review never
  waits behind a stranger's. The
  claims are read unverified (`claimed_account`), and only to choose the lane and to shorten
  how long an answer is kept, never to accept: whatever a token says of itself, only the API
  server's answer lets it in.
- **Claims can be forged**, so the minds' lane is bounded per source address and account
  (`KNOWN_PER_SOURCE` distinct tokens waiting); a source whose token in the minds' lane is
  refused is sent to the strangers' lane for `refused_seconds` (`demoted`): a stranger naming a
  mind in forged tokens costs the API server a review or two, and never that mind's place.
- **The strangers' lane** holds at most `STRANGERS_WAITING` tokens waiting, at most
  `STRANGER_PER_SOURCE` of one source address, and starts at most `STRANGER_REVIEWS_PER_SECOND`
  reviews a second (a token bucket of `STRANGER_BURST`): past any of them a request is answered
  "unavailable" at once (`ReviewUnavailable`, a 503 its client may retry), so a flood of
  strangers costs the API server at most that rate.
- **Revocation.** An accepted token is kept `accepted_seconds` (10 s), never past its own
  `exp`; one used after `refresh_seconds` (5 s) is reviewed again in the background while it
  is served, and dropped at once if the API server now refuses it. A token the API server
  stops accepting (its pod or account deleted) is refused within `accepted_seconds` of that,
  within `refresh_seconds` plus one review if it is in use. A mind in use costs the API
  server a review every `refresh_seconds`.
- A refused token is kept a short while in a cache of its own (a stranger's tokens never evict
  a mind's); requests of one token in flight share one review.

A review the API server did not answer (unreachable, throttled, timed out) is
`ReviewUnavailable` too, never a refusal: the token was not judged, and a `401` would tell
her client to give up on a token that is good.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from continuum_operator.door.accounts import ReviewUnavailable, ServiceAccount, service_account
from continuum_operator.kube.client.async_api import AsyncKubeApi

__all__ = [
    "KNOWN_PER_SOURCE",
    "KNOWN_WAITING",
    "REVIEW_TIMEOUT",
    "STRANGERS_WAITING",
    "STRANGER_PER_SOURCE",
    "STRANGER_REVIEWS_PER_SECOND",
    "Caller",
    "ReviewUnavailable",
    "TokenReviewer",
    "caller_of",
    "claimed_account",
]

log = logging.getLogger(__name__)

#: Seconds one TokenReview may take, connected and answered: a review that never answers would
#: hold her request (and its place in its lane) forever.
REVIEW_TIMEOUT = 10.0
#: TokenReviews in flight at once, per lane; the lane's others wait their turn.
REVIEWS_PER_LANE = 4
#: Distinct tokens waiting in the minds' lane, all together and per (source, account).
KNOWN_WAITING = 256
KNOWN_PER_SOURCE = 2
#: Distinct tokens waiting in the strangers' lane, all together and per source address.
STRANGERS_WAITING = 32
STRANGER_PER_SOURCE = 2
#: Reviews of strangers' tokens started per second, and the bucket's depth.
STRANGER_REVIEWS_PER_SECOND = 20.0
STRANGER_BURST = 20
#: Accepted and refused tokens kept; sources demoted to the strangers' lane kept.
ACCEPTED_KEPT = 4096
REFUSED_KEPT = 1024
DEMOTED_KEPT = 4096
#: The longest token whose claims are read (a service account's is 1 to 2 KiB).
CLAIMS_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sends a token, as far as the door can tell before the review: the source address,
    and whether the token's unverified claims name an account the door knows (a Mind in the
    grant table). Chooses the lane only; see the module's docstring."""

    source: str
    known: bool = False
    claimed: ServiceAccount | None = None


def _claims(token: str) -> dict[str, Any] | None:
    """A JWT's payload, unverified; None if the token is not one."""
    parts = token.split(".")
    if len(token) > CLAIMS_BYTES or len(parts) != 3:
        return None
    try:
        raw = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(raw)
    except (binascii.Error, ValueError):
        return None
    return claims if isinstance(claims, dict) else None


def claimed_account(token: str) -> ServiceAccount | None:
    """The service account a token says it belongs to (its `sub`), UNVERIFIED: for choosing a
    review lane, never for access."""
    claims = _claims(token)
    sub = claims.get("sub") if claims is not None else None
    return service_account(sub) if isinstance(sub, str) else None


def _claimed_expiry(token: str) -> float | None:
    """The token's own `exp` (Unix seconds), unverified: it may only shorten a cache entry."""
    claims = _claims(token)
    exp = claims.get("exp") if claims is not None else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


def caller_of(token: str, source: str, knows: Callable[[ServiceAccount], bool]) -> Caller:
    """The caller of a request: its source address, and whether the token claims an account
    `knows` (the gateway: a Mind with an entry in its grant table)."""
    claimed = claimed_account(token)
    return Caller(source, claimed is not None and knows(claimed), claimed)


@dataclass(slots=True)
class _Bucket:
    """Reviews a lane may start: `rate` a second, at most `burst` at once."""

    rate: float
    burst: int
    level: float = 0.0
    at: float = 0.0

    def take(self, now: float) -> bool:
        self.level = min(float(self.burst), self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


@dataclass(slots=True)
class _Waiting:
    task: asyncio.Task[ServiceAccount | None]
    known: bool
    key: tuple[str, str]  # (source, claimed account or "") it is counted under


@dataclass(eq=False)
class TokenReviewer:
    """Reviews a bearer token with the API server (a TokenReview with `audience`): the service
    account it belongs to, or None (refused). A token is accepted only where the API server
    says it was issued for that audience, so a service account's ordinary token (the API
    server's audience) or one projected for another engine or lane is refused. Raises
    `ReviewUnavailable` when no answer could be had, or the caller's lane is full.

    `api`: the process's adapter (`kube.client.async_api.AsyncKubeApi`, or anything with its
    `create`); None: one is connected at the first review, from `kubeconfig` (else
    $KUBECONFIG, ~/.kube, or the pod's ServiceAccount), and `close` closes it."""

    audience: str
    _: KW_ONLY
    api: Any = None
    kubeconfig: str | None = None
    accepted_seconds: float = 10.0
    refresh_seconds: float = 5.0
    refused_seconds: float = 10.0
    clock: Callable[[], float] = time.monotonic
    #: The wall clock, against a token's own `exp`.
    wall: Callable[[], float] = time.time
    _accepted: OrderedDict[str, tuple[ServiceAccount, float, float]] = field(
        default_factory=OrderedDict, init=False
    )
    _refused: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False)
    _pending: dict[str, _Waiting] = field(default_factory=dict, init=False)
    _refreshing: set[str] = field(default_factory=set, init=False)
    _demoted: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False)
    _bucket: _Bucket = field(
        default_factory=lambda: _Bucket(STRANGER_REVIEWS_PER_SECOND, STRANGER_BURST), init=False
    )
    # Places of their own: strangers' reviews do not take the minds'.
    _known_lane: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(REVIEWS_PER_LANE), init=False
    )
    _stranger_lane: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(REVIEWS_PER_LANE), init=False
    )
    _connecting: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _connected: AsyncKubeApi | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._bucket.level, self._bucket.at = float(STRANGER_BURST), self.clock()

    async def _api(self) -> Any:
        async with self._connecting:
            if self.api is None:
                self.api = self._connected = await AsyncKubeApi.connect(self.kubeconfig)
        return self.api

    async def close(self) -> None:
        """Close the adapter this reviewer connected (one it was given is its giver's)."""
        if self._connected is not None:
            await self._connected.close()
            self.api = self._connected = None

    async def _review(self, token: str) -> ServiceAccount | None:
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {},
            "spec": {"token": token, "audiences": [self.audience]},
        }
        api = self.api or await self._api()
        answered = await api.create(review, seconds=REVIEW_TIMEOUT)
        status = answered.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user:
            return None
        if self.audience not in (status.get("audiences") or []):
            return None  # an authenticator that ignored the audience: not proof enough
        return service_account(user.get("username"))

    def _kept(self, token: str, now: float) -> tuple[bool, ServiceAccount | None]:
        """(known, account) from the caches; a token in use past its refresh is reviewed again."""
        accepted = self._accepted.get(token)
        if accepted is not None and accepted[1] > now:
            self._accepted.move_to_end(token)
            if now >= accepted[2] and token not in self._refreshing:
                self._refresh(token)
            return True, accepted[0]
        refused = self._refused.get(token)
        return (refused is not None and refused > now), None

    def _keep(self, token: str, account: ServiceAccount | None) -> None:
        now = self.clock()
        if account is None:
            self._accepted.pop(token, None)
            self._refused[token] = now + self.refused_seconds
            self._refused.move_to_end(token)
            while len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
            return
        self._refused.pop(token, None)
        until = now + self.accepted_seconds
        exp = _claimed_expiry(token)
        if exp is not None:
            until = min(until, now + (exp - self.wall()))
        self._accepted[token] = (account, until, now + self.refresh_seconds)
        self._accepted.move_to_end(token)
        while len(self._accepted) > ACCEPTED_KEPT:
            self._accepted.popitem(last=False)

    def _refresh(self, token: str) -> None:
        """Review an accepted token in use again, in the minds' lane, while it is served."""
        self._refreshing.add(token)

        async def again() -> None:
            try:
                await self._reviewed(token, self._known_lane)
            except ReviewUnavailable:
                pass  # kept until its entry lapses; then reviewed before it is served
            finally:
                self._refreshing.discard(token)

        asyncio.get_running_loop().create_task(again())

    async def _reviewed(self, token: str, lane: asyncio.Semaphore) -> ServiceAccount | None:
        try:
            async with lane:
                account = await self._review(token)
        except Exception as err:  # not answered: not judged, not kept
            log.warning("token review failed: %s", err)
            raise ReviewUnavailable(f"the API server did not answer the review: {err}") from err
        self._keep(token, account)
        return account

    def _lane(self, caller: Caller | None, now: float) -> tuple[bool, tuple[str, str]]:
        """(minds' lane?, the key its waiting tokens are counted under)."""
        if caller is None:
            return True, ("", "")  # a door that names no callers: one lane, as before lanes
        demoted = self._demoted.get(caller.source)
        if caller.known and caller.claimed is not None and not (demoted and demoted > now):
            return True, (caller.source, caller.claimed.mind)
        return False, (caller.source, "")

    def _admit(self, known: bool, key: tuple[str, str], now: float) -> None:
        """Raises `ReviewUnavailable` where the lane has no room for one more token."""
        same = [w for w in self._pending.values() if w.known == known]
        if known:
            if len(same) >= KNOWN_WAITING:
                raise ReviewUnavailable(f"{KNOWN_WAITING} token reviews are waiting already")
            if key != ("", "") and sum(w.key == key for w in same) >= KNOWN_PER_SOURCE:
                raise ReviewUnavailable(
                    f"{KNOWN_PER_SOURCE} tokens of {key[1]} from {key[0]} wait for review already"
                )
            return
        if len(same) >= STRANGERS_WAITING:
            raise ReviewUnavailable(f"{STRANGERS_WAITING} unknown tokens wait for review already")
        if sum(w.key == key for w in same) >= STRANGER_PER_SOURCE:
            raise ReviewUnavailable(
                f"{STRANGER_PER_SOURCE} unknown tokens from {key[0]} wait for review already"
            )
        if not self._bucket.take(now):
            raise ReviewUnavailable(
                f"unknown tokens are reviewed at most {STRANGER_REVIEWS_PER_SECOND:g} a second"
            )

    async def __call__(self, token: str, caller: Caller | None = None) -> ServiceAccount | None:
        now = self.clock()
        known, account = self._kept(token, now)
        if known:
            return account
        waiting = self._pending.get(token)
        if waiting is None:
            in_known, key = self._lane(caller, now)
            self._admit(in_known, key, now)
            lane = self._known_lane if in_known else self._stranger_lane
            # A task of its own: a caller who goes away does not cancel the others' answer.
            task = asyncio.get_running_loop().create_task(self._reviewed(token, lane))
            waiting = self._pending[token] = _Waiting(task, in_known, key)
            task.add_done_callback(lambda done: self._settled(token, done, in_known, key))
        return await asyncio.shield(waiting.task)

    def _settled(
        self,
        token: str,
        task: asyncio.Task[ServiceAccount | None],
        known: bool,
        key: tuple[str, str],
    ) -> None:
        self._pending.pop(token, None)
        if task.cancelled() or task.exception() is not None:
            return  # retrieved here too: every caller may have gone
        if known and key[0] and task.result() is None:
            # A token in the minds' lane the API server refused: its source claimed a mind it
            # is not; its next tokens wait with the strangers'.
            self._demoted[key[0]] = self.clock() + self.refused_seconds
            self._demoted.move_to_end(key[0])
            while len(self._demoted) > DEMOTED_KEPT:
                self._demoted.popitem(last=False)
