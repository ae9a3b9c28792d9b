"""Board freshness counted on the operator's clock from when it saw each renewal
(`lease_renewal.renewal_counted_from`, `occupancy.lease_is_fresh`), never the agent's
`renewTime` against the operator's clock: an agent whose clock runs ahead cannot keep a dead
node's board fresh, and one whose clock runs behind is believed from its next renewal."""

from __future__ import annotations

import argparse

from continuum_operator.core.heartbeat import agent_lease_metadata
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.occupancy import lease_is_fresh

NOW = 1_800_000_000.0
TTL = 40


class World:
    """One operator's clock and one agent's, `skew` seconds apart."""

    def __init__(self, skew: float) -> None:
        self.now, self.skew, self.rv = NOW, skew, 0
        self.cache = Cache(clock=lambda: self.now)

    def renew(self) -> None:
        self.rv += 1
        meta = {**agent_lease_metadata("n1"), "resourceVersion": str(self.rv)}
        spec = {"renewTime": format_seconds(self.now + self.skew), "leaseDurationSeconds": TTL}
        self.cache.observe_lease({"metadata": meta, "spec": spec}, deleted=False)

    def fresh(self) -> bool:
        return lease_is_fresh(self.cache.leases.get("n1"), self.now, 600.0)


def test_an_agent_4_s_ahead_that_stops_renewing_is_stale_a_duration_after_its_last_renewal() -> (
    None
):
    w = World(skew=4.0)
    for _ in range(5):
        w.renew()
        w.now += 10
    w.now += TTL - 10 + 1  # the last renewal was seen TTL + 1 s ago
    assert not w.fresh()  # on the agent's clock it would have 3 s left


def test_an_agent_far_behind_is_believed_from_its_next_renewal() -> None:
    w = World(skew=-3_600.0)
    w.renew()
    assert not w.fresh()  # first sight: its renewTime is an hour old, and may be
    w.now += 10
    w.renew()
    assert w.fresh()  # its clock moved on: a renewal, counted from when it was seen
    w.now += TTL
    assert w.fresh()
    w.now += 1
    assert not w.fresh()


def test_a_lease_first_seen_long_after_its_renewal_is_stale_and_one_moved_back_is_not_renewed() -> (
    None
):
    w = World(skew=0.0)
    w.renew()
    w.skew = -7_200.0  # rewritten with an old renewTime (a clock set back, a forged write)
    w.now += 1
    w.renew()
    assert not w.fresh()


def test_a_lease_claiming_a_duration_of_years_is_stale_past_the_operators_longest() -> None:
    # The agent writes its own Lease: 2^31-1 seconds kept a dead node's board fresh for 68 years.
    w = World(skew=0.0)
    w.cache = Cache(clock=lambda: w.now, max_lease_seconds=300.0)
    w.rv += 1
    meta = {**agent_lease_metadata("n1"), "resourceVersion": str(w.rv)}
    spec = {"renewTime": format_seconds(w.now), "leaseDurationSeconds": 2**31 - 1}
    w.cache.observe_lease({"metadata": meta, "spec": spec}, deleted=False)
    w.now += 300
    assert w.fresh()
    w.now += 1
    assert not w.fresh()


def test_the_longest_a_lease_vouches_for_is_an_operator_setting() -> None:
    from continuum_operator.cli.operator import settings_from

    args = _parse(["--board-max-ttl", "120"])
    assert settings_from(args).freshness.max_ttl_seconds == 120.0
    assert settings_from(_parse([])).freshness.max_ttl_seconds == 300.0


def _parse(argv: list[str]) -> argparse.Namespace:
    from continuum_operator.cli.operator import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)
