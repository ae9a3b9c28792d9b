"""Strangers cannot lock a mind out through token review, nor make the API server review
without bound, and a token the API server stops accepting stops working within seconds
(`door.token_review`).

Found by an attacker against the gateway: 100 connections sending random bearer tokens kept
the reviewer's 64 pending reviews full, so a mind whose token was not cached was answered 503
`review_unavailable` 13 to 17 times in 20, with about 3,500 TokenReviews a second reaching the
API server; and an accepted token stayed accepted 60 s after the API server stopped accepting
it (its pod or account deleted).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from continuum_operator.door import token_review
from continuum_operator.door.token_review import (
    Caller,
    TokenReviewer,
    caller_of,
    claimed_account,
)
from continuum_operator.engine.admission import ReviewUnavailable, ServiceAccount
from tests.support.token_review import AUDIENCE, MIRA_SUB, Api, jwt
from tests.support.waiting import until

MIRA = ServiceAccount("minds", "mira")


def knows_mira(account: ServiceAccount) -> bool:
    return account == MIRA


def test_the_claims_name_the_account_unverified_and_only_a_jwt_has_them() -> None:
    assert claimed_account(jwt(MIRA_SUB)) == MIRA
    assert claimed_account("random-garbage") is None
    assert claimed_account("a.!!!.c") is None
    assert claimed_account(jwt("system:admin")) is None
    assert caller_of(jwt(MIRA_SUB), "10.0.0.1", knows_mira) == Caller("10.0.0.1", True, MIRA)
    assert caller_of("garbage", "10.0.0.1", knows_mira) == Caller("10.0.0.1", False, None)


def test_a_minds_uncached_token_is_served_while_strangers_flood() -> None:
    mira = jwt(MIRA_SUB, nonce="fresh")
    api = Api(mira, stranger_seconds=0.2)
    reviewer = TokenReviewer(AUDIENCE, api=api)
    answers: list[str] = []

    done = asyncio.Event()

    async def stranger(i: int) -> None:
        # 100 connections from a few addresses, each sending random tokens without pause.
        j = 0
        while not done.is_set():
            j += 1
            try:
                await reviewer(f"random-{i}-{j}", Caller(f"10.0.1.{i % 4}"))
            except ReviewUnavailable:
                await asyncio.sleep(0)

    async def main() -> None:
        flood = [asyncio.create_task(stranger(i)) for i in range(100)]
        await until(lambda: len(api.calls) >= 4)
        for _ in range(20):
            reviewer._accepted.clear()  # uncached each time: a fresh review
            try:
                account = await reviewer(mira, caller_of(mira, "10.0.2.7", knows_mira))
                answers.append("served" if account == MIRA else "refused")
            except ReviewUnavailable:
                answers.append("unavailable")
        done.set()
        await asyncio.gather(*flood)

    asyncio.run(main())
    assert answers == ["served"] * 20


def test_what_strangers_cost_the_api_server_is_bounded_per_second() -> None:
    now = [0.0]
    api = Api()
    reviewer = TokenReviewer(AUDIENCE, api=api, clock=lambda: now[0])

    async def main() -> dict[str, int]:
        said = {"reviewed": 0, "unavailable": 0}
        for second in range(3):
            now[0] = float(second)
            for i in range(1000):
                try:
                    await reviewer(f"random-{second}-{i}", Caller(f"10.0.{i % 250}.{second}"))
                    said["reviewed"] += 1
                except ReviewUnavailable:
                    said["unavailable"] += 1
        return said

    said = asyncio.run(main())
    # The bucket's burst, then its rate each second after; not 3,000.
    most = token_review.STRANGER_BURST + 2 * token_review.STRANGER_REVIEWS_PER_SECOND
    assert len(api.calls) <= most and said["reviewed"] == len(api.calls)


def test_a_source_forging_a_minds_claims_is_demoted_and_she_is_still_served() -> None:
    mira = jwt(MIRA_SUB, nonce="real")
    api = Api(mira)
    reviewer = TokenReviewer(AUDIENCE, api=api)

    async def main() -> None:
        forger = "10.0.3.3"
        for i in range(2):
            forged = jwt(MIRA_SUB, nonce=f"forged-{i}")
            assert await reviewer(forged, caller_of(forged, forger, knows_mira)) is None
        # Demoted: its next forged tokens wait with the strangers', at the strangers' rate.
        assert (
            reviewer._lane(caller_of(jwt(MIRA_SUB, nonce="x"), forger, knows_mira), 0)[0] is False
        )
        assert await reviewer(mira, caller_of(mira, "10.0.2.7", knows_mira)) == MIRA

    asyncio.run(main())


class TestRevocation:
    """An accepted token stops working within seconds of the API server refusing it."""

    def rig(self) -> tuple[list[float], Api, TokenReviewer, str]:
        now = [100.0]
        token = jwt(MIRA_SUB, nonce="r")
        api = Api(token)
        reviewer = TokenReviewer(AUDIENCE, api=api, clock=lambda: now[0])
        return now, api, reviewer, token

    def test_a_token_in_use_is_refused_one_refresh_after_it_is_revoked(self) -> None:
        now, api, reviewer, token = self.rig()

        async def main() -> None:
            caller = caller_of(token, "10.0.2.7", knows_mira)
            assert await reviewer(token, caller) == MIRA
            api.good.clear()  # her pod deleted: the API server refuses the token now
            now[0] += reviewer.refresh_seconds
            assert await reviewer(token, caller) == MIRA  # served while reviewed again
            await until(lambda: api.calls.count(token) == 2)
            await until(lambda: token not in reviewer._refreshing)
            assert await reviewer(token, caller) is None

        asyncio.run(main())
        assert reviewer.accepted_seconds <= 10

    def test_an_idle_token_is_reviewed_again_after_ten_seconds(self) -> None:
        now, api, reviewer, token = self.rig()

        async def main() -> None:
            assert await reviewer(token) == MIRA
            api.good.clear()
            now[0] += reviewer.accepted_seconds
            assert await reviewer(token) is None

        asyncio.run(main())

    def test_a_token_is_never_kept_past_its_own_expiry(self) -> None:
        now = [100.0]
        token = jwt(MIRA_SUB, exp=time.time() + 2)
        api = Api(token)
        reviewer = TokenReviewer(AUDIENCE, api=api, clock=lambda: now[0])

        async def main() -> None:
            assert await reviewer(token) == MIRA
            api.good.clear()
            now[0] += 3
            assert await reviewer(token) is None

        asyncio.run(main())


@pytest.mark.parametrize("n", [token_review.KNOWN_PER_SOURCE])
def test_one_source_holds_at_most_two_waiting_reviews_of_a_mind(n: int) -> None:
    hold = asyncio.Event()

    class HeldApi(Api):
        async def create(self, review: dict[str, Any], *, seconds: float | None = None) -> Any:
            await asyncio.wait_for(hold.wait(), 10)
            return await super().create(review, seconds=seconds)

    api = HeldApi()
    reviewer = TokenReviewer(AUDIENCE, api=api)

    async def main() -> None:
        tokens = [jwt(MIRA_SUB, nonce=str(i)) for i in range(n + 1)]
        waiting = [
            asyncio.create_task(reviewer(t, caller_of(t, "10.0.3.3", knows_mira)))
            for t in tokens[:n]
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(ReviewUnavailable, match="wait for review already"):
            await reviewer(tokens[n], caller_of(tokens[n], "10.0.3.3", knows_mira))
        hold.set()
        await asyncio.gather(*waiting)

    asyncio.run(main())
