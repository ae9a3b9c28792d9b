"""What a stranger's tokens cost the door (`door.token_review.TokenReviewer`): anyone who
reaches an engine's or a lane's port may send tokens, each a TokenReview with the API server.

Found by review: the cache of answers was cleared whenever it passed 4,096 tokens, so 4,097
garbage tokens had every mind reviewed again behind them, and reviews were neither bounded nor
shared between requests of one token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.door import token_review
from continuum_operator.door.token_review import Caller, TokenReviewer
from continuum_operator.engine.admission import ReviewUnavailable, ServiceAccount
from tests.support.fake_apiserver import review_answer, reviewed_token, served
from tests.support.waiting import until

AUDIENCE = "continuum.dev/engine/ml/coder"


class Api:
    """The API server's TokenReview: `good` is mira's token; any other is refused. With
    `hold`, every review waits for it to be set."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.hold = hold
        self.calls: list[str] = []

    async def create(self, review: dict[str, Any], *, seconds: float | None = None) -> Any:
        token, _ = reviewed_token(review)
        self.calls.append(token)
        if self.hold is not None:
            await asyncio.wait_for(self.hold.wait(), 10)
        ok = token == "good"
        return review_answer("system:serviceaccount:minds:mira" if ok else None, [AUDIENCE])


def test_strangers_tokens_do_not_evict_a_minds_accepted_token() -> None:
    api = Api()
    reviewer = TokenReviewer(AUDIENCE, api=api)

    async def main() -> None:
        assert await reviewer("good") == ServiceAccount("minds", "mira")
        for i in range(token_review.ACCEPTED_KEPT + 1):
            assert await reviewer(f"garbage-{i}") is None
        assert await reviewer("good") == ServiceAccount("minds", "mira")

    asyncio.run(main())
    assert api.calls.count("good") == 1
    assert len(reviewer._refused) == token_review.REFUSED_KEPT  # the oldest went first


def test_a_refused_token_sent_again_costs_one_review() -> None:
    api = Api()
    reviewer = TokenReviewer(AUDIENCE, api=api)

    async def main() -> None:
        for _ in range(50):
            assert await reviewer("forged") is None

    asyncio.run(main())
    assert api.calls == ["forged"]


def held() -> tuple[asyncio.Event, Api, TokenReviewer]:
    """A reviewer whose API server answers once the event is set."""
    hold = asyncio.Event()
    api = Api(hold)
    return hold, api, TokenReviewer(AUDIENCE, api=api)


def test_requests_of_one_token_in_flight_share_one_review() -> None:
    hold, api, reviewer = held()

    async def main() -> None:
        asks = [asyncio.create_task(reviewer("good")) for _ in range(20)]
        await until(lambda: api.calls == ["good"])
        await asyncio.sleep(0.05)
        asks[0].cancel()  # one caller goes away: the others still get their answer
        hold.set()
        answers = await asyncio.gather(*asks[1:])
        assert set(answers) == {ServiceAccount("minds", "mira")}

    asyncio.run(main())
    assert api.calls == ["good"]


def test_a_stranger_waits_for_at_most_two_reviews_and_the_rest_are_turned_away() -> None:
    hold, api, reviewer = held()

    async def main() -> None:
        stranger = Caller("10.0.0.9")
        waiting = [
            asyncio.create_task(reviewer(f"garbage-{i}", stranger))
            for i in range(token_review.STRANGER_PER_SOURCE)
        ]
        await until(lambda: len(api.calls) == token_review.STRANGER_PER_SOURCE)
        with pytest.raises(ReviewUnavailable, match="wait for review already"):
            await reviewer("one-more", stranger)
        hold.set()
        assert await asyncio.gather(*waiting) == [None] * token_review.STRANGER_PER_SOURCE

    asyncio.run(main())
    assert "one-more" not in api.calls


def test_a_token_is_reviewed_over_the_adapter_with_the_audience(tmp_path: Path) -> None:
    """The TokenReview the reviewer sends on `AsyncKubeApi` is one the API server takes: a
    TokenReview of the token for the door's audience, created at its collection."""

    async def main() -> None:
        async with served(tmp_path) as (fake, api):
            mira = "system:serviceaccount:minds:mira"
            fake.tokens = {"good": (mira, [AUDIENCE]), "elsewhere": (mira, ["another"])}
            reviewer = TokenReviewer(AUDIENCE, api=api)
            assert await reviewer("good") == ServiceAccount("minds", "mira")
            assert await reviewer("elsewhere") is None  # issued for another audience
            assert await reviewer("forged") is None
            # One with no adapter connects its own at its first review, and closes it.
            own = TokenReviewer(AUDIENCE, kubeconfig=str(tmp_path / "kubeconfig"))
            assert await own("good") == ServiceAccount("minds", "mira")
            connected = own.api
            await own.close()
            assert connected is not None and connected._session.closed and own.api is None
            sent = fake.reviews[0]
            assert sent["apiVersion"] == "authentication.k8s.io/v1"
            assert sent["kind"] == "TokenReview"
            assert sent["spec"] == {"token": "good", "audiences": [AUDIENCE]}

    asyncio.run(main())


def test_an_api_server_that_does_not_answer_is_unavailable_and_not_kept() -> None:
    class DownApi:
        calls = 0

        async def create(self, review: dict[str, Any], *, seconds: float | None = None) -> Any:
            self.calls += 1
            raise ConnectionError("connection refused")

    api = DownApi()
    reviewer = TokenReviewer(AUDIENCE, api=api)
    for _ in range(2):
        with pytest.raises(ReviewUnavailable, match="connection refused"):
            asyncio.run(reviewer("good"))
    assert api.calls == 2
