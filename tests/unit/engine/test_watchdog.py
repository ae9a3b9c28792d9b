"""The decode watchdog's judgement (`engine.watchdog`), pure: what counts as a stall of the
shared loop, against what reference, and whom it cuts."""

from __future__ import annotations

from continuum_operator.engine.watchdog import (
    STALL_REASON,
    Reading,
    Watchdog,
    WatchdogSettings,
    decide,
    step_seconds,
)

SETTINGS = WatchdogSettings(factor=3.0, floor_seconds=0.05, patience=2)


def test_a_long_prompts_decode_is_not_a_stall_but_a_loop_that_does_not_answer_is() -> None:
    before = Reading(0.0, 0.001, {0: 10})
    # llama-server answered at once (it yields while decoding) though slot 0 gained 1 token in
    # 2 s: a long prompt beside it, not sampling.
    assert step_seconds(before, Reading(2.0, 0.001, {0: 11})) == 0.002
    # It answered after 0.8 s and slot 0 gained 2 tokens in 2 s: a step of about a second.
    assert step_seconds(before, Reading(2.0, 0.8, {0: 12})) == 1.0
    # A probe that timed out says only that the loop did not answer.
    assert step_seconds(before, Reading(2.0, 2.0, {})) == 4.0


def test_the_reference_learns_only_without_suspects_and_a_cut_needs_patience() -> None:
    v = decide(0.01, 0.0, 0, suspects=0, settings=SETTINGS)
    assert (v.reference, v.cut) == (0.01, False)
    bound = SETTINGS.factor * SETTINGS.floor_seconds  # the floor, over a tiny reference
    v = decide(bound * 0.9, 0.01, 0, suspects=1, settings=SETTINGS)
    assert (v.over, v.cut) == (0, False)
    v = decide(bound * 2, 0.01, 0, suspects=1, settings=SETTINGS)
    assert (v.reference, v.over, v.cut) == (0.01, 1, False)
    v = decide(bound * 2, 0.01, v.over, suspects=1, settings=SETTINGS)
    assert v.cut
    assert not decide(10.0, 0.01, 5, suspects=0, settings=SETTINGS).cut  # nobody to blame


class Flight:
    def __init__(self) -> None:
        self.ended: tuple[str, str | None] | None = None

    def end(self, reason: str, by: str | None) -> None:
        self.ended = (reason, by)


def test_the_suspect_that_started_last_is_cut_and_ordinary_requests_never() -> None:
    now = [0.0]
    dog = Watchdog(lambda: "http://x", SETTINGS, clock=lambda: now[0])
    first, last, plain = Flight(), Flight(), Flight()
    dog.watch(first, ("grammar",))
    now[0] = 1.0
    dog.watch(last, ("json_schema",))
    dog.watch(plain, ())
    for i in range(SETTINGS.patience):
        dog.observe(Reading(2.0 + i, 1.0, {}))
    assert (first.ended, last.ended, plain.ended) == (None, (STALL_REASON, None), None)
    dog.forget(first)
    for i in range(SETTINGS.patience):
        dog.observe(Reading(5.0 + i, 1.0, {}))
    assert first.ended is None and plain.ended is None and dog.cuts == 1
