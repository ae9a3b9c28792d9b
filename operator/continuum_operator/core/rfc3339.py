"""RFC 3339 times as the API server and our status fields carry them, and Unix seconds inside.

The one home of the conversions the operator, the agent's neighbours and the webhook use:
decisions take Unix seconds (an injected clock), status and Leases hold RFC 3339 text. A writer
for each need: `format_seconds` (whole seconds, as conditions and events carry them),
`format_micro` (a Lease's MicroTime, six fraction digits; the agent's clock hands it a datetime),
`format_milli` (the gateway's log and report times, three digits), `format_isoformat` (six digits,
or none for a whole second: the gateway's grant table), `format_exact` (the shortest fraction
that `parse_exact` reads back as the same float: a journaled step logged with the times it was
decided at). `parse` reads any of them, and the API server's own, leniently: None, never an
error, for anything that is not such a time. Pure: no clock is read here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, localcontext
from typing import Any

__all__ = [
    "format_exact",
    "format_isoformat",
    "format_micro",
    "format_milli",
    "format_seconds",
    "parse",
    "parse_exact",
]


def format_seconds(epoch: float) -> str:
    """Unix seconds as RFC 3339 in whole seconds (the fraction dropped): `2026-12-03T18:00:00Z`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro(epoch: float | datetime) -> str:
    """Unix seconds (or a datetime: its instant, a naive one taken as local time) as RFC 3339
    with microseconds, as a Lease's MicroTime fields hold them: `2026-12-03T18:00:00.000000Z`."""
    # A datetime is written as it is, not through Unix seconds: no float in between to round.
    at = (
        epoch.astimezone(UTC) if isinstance(epoch, datetime) else datetime.fromtimestamp(epoch, UTC)
    )
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_milli(epoch: float) -> str:
    """Unix seconds as RFC 3339 with milliseconds (the microseconds cut, not rounded):
    `2026-12-03T18:00:00.123Z`."""
    at = datetime.fromtimestamp(epoch, UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_isoformat(epoch: float) -> str:
    """Unix seconds as RFC 3339 as `datetime.isoformat` writes it: six fraction digits, or none
    when the time is a whole second (`2026-12-03T18:00:00Z`, `2026-12-03T18:00:00.500000Z`)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def parse(text: Any) -> float | None:
    """Unix seconds of an RFC 3339 time (`Z` or an offset); None for anything else."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def format_exact(epoch: float) -> str:
    """Unix seconds as RFC 3339 whose fraction is the shortest that `parse_exact` reads back as
    the same float."""
    positional = format(Decimal(repr(float(epoch))), "f")  # repr: the shortest exact digits
    whole, _, frac = positional.partition(".")
    stamp = datetime.fromtimestamp(int(whole), UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{frac or '0'}Z"


def parse_exact(value: Any) -> float | None:
    """Unix seconds from `format_exact`'s text (or a number, as journals were once written);
    None for anything else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str) or not value.endswith("Z"):
        return None
    head, _, frac = value[:-1].partition(".")
    if frac and not frac.isdigit():
        return None
    try:
        whole = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
        with localcontext() as exact:
            exact.prec = 60  # wide enough that the sum below is exact
            return float(Decimal(int(whole)) + Decimal(f"0.{frac or '0'}"))
    except (ValueError, ArithmeticError):
        return None
