"""Who a bearer token speaks for: a TokenReview with the API server, for one audience.

The engine's gateway (a mind's token, the engine's audience) and an EmbedLane's runtime (a
caller's token, the lane's audience) both open their door with `TokenReviewer`. Anyone who
reaches the port may send a token, so what a stranger's tokens cost is bounded:

- an accepted token is kept for `cache_seconds` in a cache of its own, least recently used
  evicted first, so no number of strangers' tokens evicts a mind's (a cache cleared when full
  had every mind reviewed again, behind the strangers);
- a refused token is kept a short while in a smaller cache, so one token sent again and again
  costs one review;
- the reviews of one token in flight at once are one review;
- at most `MAX_IN_FLIGHT` reviews run at once, and at most `MAX_WAITING` distinct tokens wait
  for one: past that a request is answered "unavailable" (`ReviewUnavailable`, a 503 its
  client may retry) rather than queued without bound.

A review the API server did not answer (unreachable, throttled, timed out) is
`ReviewUnavailable` too, never a refusal: the token was not judged, and a `401` would tell
her client to give up on a token that is good.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from continuum_operator.engine.admission import ReviewUnavailable, ServiceAccount, service_account
from continuum_operator.engine.grants_source import custom_objects

__all__ = ["MAX_IN_FLIGHT", "MAX_WAITING", "REVIEW_TIMEOUT", "ReviewUnavailable", "TokenReviewer"]

log = logging.getLogger(__name__)

#: Seconds to connect to and hear from the API server for one TokenReview.
REVIEW_TIMEOUT = (5.0, 10.0)
#: TokenReviews running at once (each holds one of the reviewer's threads).
MAX_IN_FLIGHT = 8
#: Distinct tokens waiting for a review (running included) before a request is turned away.
MAX_WAITING = 64
#: Accepted and refused tokens kept.
ACCEPTED_KEPT = 4096
REFUSED_KEPT = 1024


def _review_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="token-review")


@dataclass(eq=False)
class TokenReviewer:
    """Reviews a bearer token with the API server (a TokenReview with `audience`): the service
    account it belongs to, or None (refused). A token is accepted only where the API server
    says it was issued for that audience, so a service account's ordinary token (the API
    server's audience) or one projected for another engine or lane is refused. Raises
    `ReviewUnavailable` when no answer could be had."""

    audience: str
    _: KW_ONLY
    api: Any = None
    cache_seconds: float = 60.0
    refused_seconds: float = 10.0
    _accepted: OrderedDict[str, tuple[ServiceAccount, float]] = field(
        default_factory=OrderedDict, init=False
    )
    _refused: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False)
    _pending: dict[str, asyncio.Task[ServiceAccount | None]] = field(
        default_factory=dict, init=False
    )
    # Threads of its own: strangers' reviews do not take the default pool's threads, which the
    # rest of the runtime's blocking calls use.
    _threads: ThreadPoolExecutor = field(default_factory=_review_threads, init=False)

    def _review(self, token: str) -> ServiceAccount | None:
        client: Any = importlib.import_module("kubernetes.client")
        if self.api is None:
            custom_objects()  # loads the configuration
            self.api = client.AuthenticationV1Api()
        review = client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=[self.audience])
        )
        # Bounded: a review that never answers would hold her request (and its slot) forever.
        status = self.api.create_token_review(review, _request_timeout=REVIEW_TIMEOUT).status
        if status is None or not status.authenticated or status.user is None:
            return None
        if self.audience not in (status.audiences or []):
            return None  # an authenticator that ignored the audience: not proof enough
        return service_account(status.user.username)

    def _kept(self, token: str, now: float) -> tuple[bool, ServiceAccount | None]:
        """(known, account) from the caches."""
        accepted = self._accepted.get(token)
        if accepted is not None and accepted[1] > now:
            self._accepted.move_to_end(token)
            return True, accepted[0]
        refused = self._refused.get(token)
        return (refused is not None and refused > now), None

    def _keep(self, token: str, account: ServiceAccount | None) -> None:
        now = time.monotonic()
        if account is None:
            self._refused[token] = now + self.refused_seconds
            self._refused.move_to_end(token)
            while len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
            return
        self._refused.pop(token, None)
        self._accepted[token] = (account, now + self.cache_seconds)
        self._accepted.move_to_end(token)
        while len(self._accepted) > ACCEPTED_KEPT:
            self._accepted.popitem(last=False)

    async def _reviewed(self, token: str) -> ServiceAccount | None:
        loop = asyncio.get_running_loop()
        try:
            account = await loop.run_in_executor(self._threads, self._review, token)
        except Exception as err:  # not answered: not judged, not kept
            log.warning("token review failed: %s", err)
            raise ReviewUnavailable(f"the API server did not answer the review: {err}") from err
        self._keep(token, account)
        return account

    async def __call__(self, token: str) -> ServiceAccount | None:
        known, account = self._kept(token, time.monotonic())
        if known:
            return account
        task = self._pending.get(token)
        if task is None:
            if len(self._pending) >= MAX_WAITING:
                raise ReviewUnavailable(f"{MAX_WAITING} token reviews are waiting already")
            # A task of its own: a caller who goes away does not cancel the others' answer.
            task = asyncio.get_running_loop().create_task(self._reviewed(token))
            self._pending[token] = task
            task.add_done_callback(lambda done: self._settled(token, done))
        return await asyncio.shield(task)

    def _settled(self, token: str, task: asyncio.Task[ServiceAccount | None]) -> None:
        self._pending.pop(token, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: every caller may have gone
