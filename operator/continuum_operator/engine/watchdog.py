"""The decode watchdog: a request whose sampling stalls the engine's shared loop is cut.

`engine.request_cost` bounds the shapes known to cost every slot (grammars, schemas); this
measures what a request that passed costs, since what a shape costs depends on the model's
vocabulary and the machine. llama-server samples every slot in one loop, and answers `GET
/slots` between its steps and while it decodes (it yields to its queue then), never while it
samples: so the time `/slots` takes to answer, and the tokens each slot decoded between two
answers (`next_token[0].n_decoded`), are the step time every slot pays.

A **suspect** is a request with a field whose cost grows per token
(`request_cost.costly_fields`: grammar, schema, tools, logit_bias, DRY breakers). Each
`probe_seconds` (1 s) while one runs (only then, and no more often: llama-server 0.3.36, asked
`/slots` four times a second, dropped a cut request and erased its slot seconds late), the
watchdog asks `/slots`
and takes the step time outside decoding (`step_seconds`): twice the probe's wait, and no less
than the generating slots' seconds per token since the last probe, so a long prompt's decode
(answered through) is not a stall. The reference is what sharing the engine costs anyway: the
step time seen without a suspect, and at least `floor_seconds`, which is what it is in
practice (sampling without a grammar takes milliseconds a step). A step time over `factor` x
the reference (the other slots decoding at less than a third of their rate beside ordinary
requests) for `patience` probes in a row cuts the suspect that started last, with the reason
`SamplingStalledEngine` and a message saying what to change; the next suspect only if the
stall goes on. Nothing else is cut: a stall with no suspect running is the engine's ordinary
work (a long prompt), which the plan accounts for.

What it does not do: a single step llama-server is inside cannot be shortened (the cut takes
effect at its end), which is why the shapes are bounded first. `decide` is pure; `Watchdog`
does the probing. Neighbours: `engine.gateway` (registers flights, cuts), `engine.request_cost`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

__all__ = [
    "STALL_REASON",
    "Cuttable",
    "Reading",
    "Watchdog",
    "WatchdogSettings",
    "cut_message",
    "decide",
]

log = logging.getLogger(__name__)

#: The reason a cut request carries (her answer's `reason`, the turn-cut metric's label).
STALL_REASON = "SamplingStalledEngine"


def cut_message(reason: str) -> str | None:
    """What a mind reads when the watchdog cut her request; None for any other cut."""
    if reason != STALL_REASON:
        return None
    return (
        "request cut: its sampling (grammar, schema, tools, logit_bias) held the engine's "
        "shared loop, so every mind on it decoded at a fraction of its rate; send a simpler "
        "grammar or schema (fewer alternatives at one position), or none"
    )


class Cuttable(Protocol):
    """A request in flight the watchdog may end (the gateway's flight)."""

    def end(self, reason: str, by: str | None) -> None: ...


@dataclass(frozen=True, slots=True)
class WatchdogSettings:
    #: Seconds between probes of llama-server's `/slots` (asked four times a second,
    #: llama-server 0.3.36 was seconds late dropping a request whose client left).
    probe_seconds: float = 1.0
    #: How many times the reference step time counts as a stall.
    factor: float = 3.0
    #: The least reference step time (seconds per token): below it a stall is not told apart
    #: from the noise of a loaded machine.
    floor_seconds: float = 0.05
    #: Probes in a row over the bound before a cut.
    patience: int = 2
    #: Weight of each new step time in the reference (an exponential average).
    smoothing: float = 0.2


@dataclass(frozen=True, slots=True)
class Reading:
    """One answer of `/slots`: when it was asked, how long it took, tokens decoded per slot."""

    at: float
    waited: float
    decoded: Mapping[int, int]


def step_seconds(before: Reading | None, now: Reading) -> float:
    """The step time the loop showed between two readings, counted only where it was not
    decoding: the probe lands anywhere in a stretch the loop does not answer (sampling), so
    twice its wait estimates that stretch; and no generating slot may have decoded faster than
    that (seconds per token since the last reading). A long prompt's decode (llama-server
    answers while it decodes) is the engine's ordinary cost, and is not a stall."""
    stretch = 2.0 * now.waited
    if before is None:
        return stretch
    elapsed = now.at - before.at
    per_token = [
        elapsed / max(n - before.decoded[slot], 1) if n - before.decoded[slot] > 0 else elapsed
        for slot, n in now.decoded.items()
        if slot in before.decoded and n > 0
    ]
    return min(stretch, min(per_token)) if per_token else stretch


@dataclass(frozen=True, slots=True)
class CutDecision:
    """One probe judged: the new reference time, the probes over the bound in a row, and
    whether to cut."""

    reference: float
    over: int
    cut: bool


def decide(
    step: float, reference: float, over: int, suspects: int, settings: WatchdogSettings
) -> CutDecision:
    """Pure: the new reference and count of probes over the bound, and whether to cut."""
    bound = settings.factor * max(reference, settings.floor_seconds)
    if suspects == 0:
        smoothed = step if reference <= 0 else reference + settings.smoothing * (step - reference)
        return CutDecision(smoothed, 0, cut=False)
    if step <= bound:
        return CutDecision(reference, 0, cut=False)
    return CutDecision(reference, over + 1, cut=over + 1 >= settings.patience)


@dataclass(eq=False)
class Watchdog:
    """Probes llama-server's loop and cuts the suspect that stalls it (see the module)."""

    #: llama-server's base URL, read at each probe (the runtime sets it once it listens).
    upstream: Callable[[], str]
    settings: WatchdogSettings = field(default_factory=WatchdogSettings)
    on_cut: Callable[[str], None] = lambda reason: None
    clock: Callable[[], float] = time.monotonic
    reference: float = 0.0
    cuts: int = 0
    _suspects: dict[Cuttable, float] = field(default_factory=dict, init=False)
    _last: Reading | None = field(default=None, init=False)
    _over: int = field(default=0, init=False)

    def watch(self, flight: Cuttable, costly: tuple[str, ...]) -> None:
        """A request now in flight: a suspect if it has a field whose cost grows per token."""
        if costly:
            self._suspects[flight] = self.clock()

    def forget(self, flight: Cuttable) -> None:
        self._suspects.pop(flight, None)

    async def _read(self, session: aiohttp.ClientSession) -> Reading | None:
        """One probe; a probe that waited past the bound counts as that long a step."""
        asked = self.clock()
        bound = self.settings.factor * max(self.reference, self.settings.floor_seconds)
        try:
            async with asyncio.timeout(max(bound * 2, 1.0)):
                async with session.get(f"{self.upstream()}/slots") as resp:
                    slots = await resp.json(content_type=None)
        except TimeoutError:
            return Reading(asked, self.clock() - asked, {})
        except (aiohttp.ClientError, ValueError):
            return None  # not serving: the runtime's health says so
        return Reading(asked, self.clock() - asked, _decoded(slots))

    def observe(self, reading: Reading) -> None:
        """Take one reading: update the reference, cut if the stall has gone on."""
        step = step_seconds(self._last, reading)
        self._last = reading if reading.decoded else None
        verdict = decide(step, self.reference, self._over, len(self._suspects), self.settings)
        self.reference, self._over = verdict.reference, verdict.over
        if verdict.cut:
            latest = max(self._suspects, key=lambda f: self._suspects[f])
            del self._suspects[latest]
            self._over = 0
            self.cuts += 1
            log.warning(
                "cut a request whose sampling stalled the loop: %.3f s a step, reference %.3f s",
                step,
                self.reference,
            )
            latest.end(STALL_REASON, None)
            self.on_cut(STALL_REASON)

    async def run(self) -> None:
        # A connection per probe, closed after it: llama-server serves each open connection
        # with one of its few HTTP threads (n_parallel + 2) for as long as it is kept alive,
        # and a probe's kept connection took the thread a reclaim's erase was waiting for.
        connector = aiohttp.TCPConnector(force_close=True, limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                await asyncio.sleep(self.settings.probe_seconds)
                if not self._suspects:
                    # Probed only while a suspect runs: llama-server 0.3.36, asked `/slots`
                    # four times a second, cancelled a dropped request and erased its slot
                    # seconds late (a reclaim's erase missed a 10 s deadline).
                    self._last, self._over = None, 0
                    continue
                reading = await self._read(session)
                if reading is not None:
                    self.observe(reading)


def _decoded(slots: Any) -> dict[int, int]:
    """Tokens decoded so far per generating slot, from `/slots`."""
    out: dict[int, int] = {}
    if not isinstance(slots, list):
        return out
    for slot in slots:
        if not isinstance(slot, dict) or not slot.get("is_processing"):
            continue
        tokens = slot.get("next_token")
        first = tokens[0] if isinstance(tokens, list) and tokens else tokens
        n = first.get("n_decoded") if isinstance(first, dict) else None
        if isinstance(n, int) and isinstance(slot.get("id"), int):
            out[slot["id"]] = n
    return out
