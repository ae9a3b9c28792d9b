"""Leader election (`kube.process.leader`) against a stand-in for the API server's Lease semantics:
create refused when it exists, replace refused (409) on a stale resourceVersion. Time is a fake
clock: no sleeps."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from continuum_operator.cli import build_parser
from continuum_operator.cli.operator_sections import leader_settings, refusal
from continuum_operator.kube.base.grant_settings import LeaderSettings
from continuum_operator.kube.process.leader import Elector, lead
from tests.support.fakes import FakeKubeApi


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Skewed:
    """Another process's view of the same time: its clock `offset` seconds apart."""

    def __init__(self, clock: Clock, offset: float) -> None:
        self.clock, self.offset = clock, offset

    def __call__(self) -> float:
        return self.clock.now + self.offset


SETTINGS = LeaderSettings(duration_seconds=10.0, renew_seconds=2.0)


def electors(
    wall_skew: float = 0.0, monotonic_skew: float = 0.0
) -> tuple[FakeKubeApi, Clock, Elector, Elector]:
    """Two replicas on one Lease; the second's wall and monotonic clocks apart by the skews."""
    api, clock = FakeKubeApi(), Clock()
    one = Elector(api, SETTINGS, "one", clock, monotonic=clock)  # type: ignore[arg-type]
    two = Elector(
        api,  # type: ignore[arg-type]
        SETTINGS,
        "two",
        Skewed(clock, wall_skew),
        monotonic=Skewed(clock, monotonic_skew),
    )
    return api, clock, one, two


def test_of_two_candidates_exactly_one_leads_and_the_other_stands_by() -> None:
    _, _, one, two = electors()
    assert one.try_acquire_or_renew() is True
    assert two.try_acquire_or_renew() is False
    assert one.is_leader() and not two.is_leader()


def test_a_standby_takes_over_only_once_the_leaders_lease_has_lapsed() -> None:
    _, clock, one, two = electors()
    one.try_acquire_or_renew()
    assert two.try_acquire_or_renew() is False  # the standby sees the Lease written
    clock.now += 9.0  # the leader died; its Lease has a second left
    assert two.try_acquire_or_renew() is False
    # The dead leader would have stopped writing before anyone could take over.
    assert not one.is_leader()
    clock.now += 1.5
    assert two.try_acquire_or_renew() is True
    assert two.is_leader()


def test_a_leader_that_renews_keeps_the_lease() -> None:
    _, clock, one, two = electors()
    one.try_acquire_or_renew()
    for _ in range(10):
        clock.now += 2.0
        assert one.try_acquire_or_renew() is True
        assert two.try_acquire_or_renew() is False
    assert one.is_leader()


def test_a_clean_stop_hands_the_lease_over_at_once() -> None:
    api, _, one, two = electors()
    one.try_acquire_or_renew()
    one.release()
    assert not one.is_leader()
    assert two.try_acquire_or_renew() is True
    lease = next(iter(api.objects.values()))
    assert lease["spec"]["holderIdentity"] == "two"
    assert lease["spec"]["leaseTransitions"] == 1


class Unreachable(FakeKubeApi):
    """The API server restarting: every request refused at the socket, as `KubeApi` raises it
    (an `OSError`; `tests/unit/kube/client/test_kube_api.py` has the real socket's)."""

    def __init__(self, leases: FakeKubeApi) -> None:
        self.__dict__.update(leases.__dict__)

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        raise ConnectionError(f"{method} {path}: connection refused")


def test_a_leader_that_cannot_reach_the_api_server_leads_on_until_its_own_deadline() -> None:
    api, clock, one, _ = electors()
    one.try_acquire_or_renew()
    one.api = Unreachable(api)  # type: ignore[assignment]
    clock.now += 2.0
    assert one.try_acquire_or_renew() is False  # no renewal, and no exception
    assert one.is_leader()  # within the duration less its margin
    clock.now += 6.5
    assert not one.is_leader()  # past it: it stops writing before a standby may take over
    one.api = api  # type: ignore[assignment]
    assert one.try_acquire_or_renew() is True  # back in time: its own Lease, renewed


def test_a_clean_stop_during_an_outage_raises_nothing_and_stops_leading() -> None:
    api, _, one, two = electors()
    one.try_acquire_or_renew()
    one.api = Unreachable(api)  # type: ignore[assignment]
    one.release()
    assert not one.is_leader()
    assert two.try_acquire_or_renew() is False  # the Lease was not handed over: it lapses


def test_a_standby_whose_wall_clock_is_4_s_ahead_never_leads_while_the_leader_does() -> None:
    # The leader renews on time, then stalls (a long pause, a cut to the API server) and
    # writes on until its own deadline; the standby polls every half second. Compared with
    # `renewTime` on its own clock, the standby took over 4 s early, while the leader still wrote.
    _, clock, one, two = electors(wall_skew=4.0, monotonic_skew=-123_456.0)
    assert one.try_acquire_or_renew() is True
    took_over = None
    for step in range(80):
        clock.now += 0.5
        if step < 10 and step % 4 == 3:
            assert one.try_acquire_or_renew() is True  # renewed on time, then no more
        two.try_acquire_or_renew()
        assert not (one.is_leader() and two.is_leader()), f"both led at {clock.now}"
        if two.is_leader() and took_over is None:
            took_over = clock.now
    assert took_over is not None  # and the standby does take over once the Lease has lapsed


def test_a_standby_counts_a_lease_it_first_sees_as_renewed_then() -> None:
    # Its `renewTime` says the Lease lapsed long ago (or a clock far behind wrote it): the
    # standby cannot tell which, so it waits a full duration from when it first saw it.
    api, clock, one, two = electors()
    one.try_acquire_or_renew()
    lease = next(iter(api.objects.values()))
    lease["spec"]["renewTime"] = "2020-01-01T00:00:00.000000Z"
    assert two.try_acquire_or_renew() is False
    clock.now += 9.9
    assert two.try_acquire_or_renew() is False
    clock.now += 0.2
    assert two.try_acquire_or_renew() is True


def test_the_lease_is_taken_while_every_shared_thread_is_busy() -> None:
    # Every API call of the loops runs in the shared executor; the Lease's must not queue
    # behind them (a renewal late past the Lease's duration loses the lead mid-write).
    _, _, one, _ = electors()

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(2))
        gate = threading.Event()
        busy = [asyncio.ensure_future(asyncio.to_thread(gate.wait)) for _ in range(4)]
        stop, working = asyncio.Event(), asyncio.Event()

        async def work(_: asyncio.Event) -> None:
            working.set()
            await stop.wait()

        leading = asyncio.create_task(lead(one, stop, [work]))
        try:
            await asyncio.wait_for(working.wait(), 2.0)
        finally:
            stop.set()
            gate.set()
            await asyncio.gather(*busy)
        return await leading

    assert asyncio.run(scenario()) == 0


def test_a_loop_cancelled_instead_of_stopped_is_named_and_the_lease_still_handed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Loops stop at `working`, between passes; one cancelled from outside (as kopf cancels
    the tasks it still waits for 5 s into its shutdown) was cut mid-pass: said, by name."""
    api, _, one, _ = electors()

    async def scenario() -> int:
        stop, started = asyncio.Event(), asyncio.Event()

        async def stops(working: asyncio.Event) -> None:
            await working.wait()

        async def hangs(_: asyncio.Event) -> None:
            started.set()
            await asyncio.Event().wait()  # never looks at `working`

        leading = asyncio.create_task(lead(one, stop, [stops, hangs]))
        await asyncio.wait_for(started.wait(), 2.0)
        hung = next(t for t in asyncio.all_tasks() if "hangs" in repr(t.get_coro()))
        hung.cancel()
        stop.set()
        return await leading

    with caplog.at_level("WARNING", logger="continuum.leader"):
        assert asyncio.run(scenario()) == 0
    warned = [r.getMessage() for r in caplog.records]
    assert any("hangs cancelled, not stopped" in m for m in warned), warned
    assert not any(".stops" in m for m in warned), warned  # it stopped
    assert api.objects[one.path]["spec"]["holderIdentity"] == ""  # handed over all the same


def _flags(duration: str, renew: str, *more: str) -> LeaderSettings:
    """The leader's settings from these flags; ValueError with `refusal`'s message where the
    operator would not start (exit 2, tests/unit/cli/test_operator_cli.py)."""
    args = build_parser().parse_args(
        ["operator", "--leader-lease-duration", duration, "--leader-renew", renew, *more]
    )
    refused = refusal(args)
    if refused is not None:
        raise ValueError(refused)
    return leader_settings(args, {})


@pytest.mark.parametrize(("duration", "renew"), [("15", "20"), ("15", "13"), ("1", "0.8")])
def test_a_renewal_interval_the_leaders_own_deadline_cannot_outlast_is_refused(
    duration: str, renew: str
) -> None:
    """Renewing every 20 s a Lease of 15 s: the sole leader's deadline (15 s less its 2 s
    margin) passes before its next renewal, so it stops writing for 7 s of every 20 and a
    standby may take the Lease meanwhile."""
    with pytest.raises(ValueError) as refused:
        _flags(duration, renew)
    message = str(refused.value)
    assert "--leader-renew" in message and "--leader-lease-duration" in message, message
    assert "renew more often or lengthen the Lease" in message
    # Without an election the two are not used: nothing to refuse.
    assert not _flags(duration, renew, "--no-leader-election").enabled


@pytest.mark.parametrize(
    ("duration", "renew"), [("15", "2"), ("15", "12.9"), ("6", "3"), ("3", "0.5")]
)
def test_a_leader_alone_leads_without_a_gap_on_every_interval_the_flags_accept(
    duration: str, renew: str
) -> None:
    s = _flags(duration, renew)
    clock = Clock()
    one = Elector(FakeKubeApi(), s, "one", clock, monotonic=clock)  # type: ignore[arg-type]
    for _ in range(5):
        assert one.try_acquire_or_renew()
        clock.now += s.renew_seconds - 0.01  # just before its next renewal
        assert one.is_leader()
        clock.now += 0.01
