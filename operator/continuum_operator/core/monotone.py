"""The largest value a monotone predicate holds for, found by bisection.

Bytes grow with each of the things the core sizes: the plan's layers on the device and its
minds (`core.plan`), a lane's context (`core.embed`). Each is the largest that still fits, so
each is found as the last value a fits-predicate holds for. Pure.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["last_true"]


def last_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int | None:
    """The largest x in [lo, hi] with pred(x), for a pred true up to a point; None if none."""
    if lo > hi or not pred(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
