"""Who a bearer token at a runtime's door speaks for, in words both doors share: the engine's
gateway (a mind's token, the engine's audience) and an embed lane (a caller's token, the lane's
audience). Pure: the review itself is `door.token_review`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REVIEW_RETRY_SECONDS",
    "SERVICE_ACCOUNT_PREFIX",
    "ReviewUnavailable",
    "ServiceAccount",
    "engine_audience",
    "lane_audience",
    "review_unavailable_message",
    "service_account",
]

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True, slots=True)
class ServiceAccount:
    """The service account a reviewed token belongs to."""

    namespace: str
    name: str

    @property
    def mind(self) -> str:
        """The one Mind it speaks for: the Mind of its name in its namespace (docs/gateway.md)."""
        return f"{self.namespace}/{self.name}"


def service_account(username: str | None) -> ServiceAccount | None:
    """The service account of a user name (`system:serviceaccount:NS:NAME`), or None."""
    if not username or not username.startswith(SERVICE_ACCOUNT_PREFIX):
        return None
    namespace, _, name = username[len(SERVICE_ACCOUNT_PREFIX) :].partition(":")
    return ServiceAccount(namespace, name) if namespace and name and ":" not in name else None


def engine_audience(namespace: str, name: str) -> str:
    """The audience a mind's token must carry for this engine (and no other) to accept it."""
    return f"continuum.dev/engine/{namespace}/{name}"


def lane_audience(namespace: str, name: str) -> str:
    """The audience a caller's token must carry for this embed lane (and no other) to accept
    it: not an engine's, so a token a mind holds for her engine does not open a lane."""
    return f"continuum.dev/embedlane/{namespace}/{name}"


class ReviewUnavailable(Exception):
    """A token that could not be reviewed now (the API server did not answer, or too many
    reviews wait): not a refusal of the token; the request may be sent again."""


#: Retry-After (seconds) when her token could not be reviewed.
REVIEW_RETRY_SECONDS = 2


def review_unavailable_message(why: str) -> str:
    """What her client is told when her token could not be reviewed: not judged, so not a
    refusal; she may send it again (after `REVIEW_RETRY_SECONDS`)."""
    return f"your token could not be reviewed now ({why}); send the request again"
