"""The engine runtime's Prometheus metrics, behind small recorder functions.

Each gateway owns a registry (tests run several in one process); `/metrics` serves it. Names
carry the `continuum_` prefix; label values are enums (`admission.Refusal`, grant reasons)
or slot numbers, never free text. The operator's and the agent's metrics live beside theirs;
docs/gateway.md lists these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from continuum_operator.engine.admission import Refusal
from continuum_operator.metric_families import MetricSet, counter, gauge

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics"]


@dataclass
class EngineMetrics(MetricSet):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    #: The minds whose parked bytes are exported (a series removed when her park goes).
    parked_minds: set[str] = field(default_factory=set)
    #: Each slot's series, once made: every request counts on five of them, and prometheus'
    #: `labels` takes a lock and builds a key per call (0.03 ms of a request's 0.7).
    _by_slot: dict[tuple[str, int, str], Any] = field(default_factory=dict, repr=False)

    refusals = counter(
        "continuum_gateway_refusals",
        "Requests the gateway refused, by reason.",
        ["reason"],
        present=[[reason.value] for reason in Refusal],
    )
    requests = counter(
        "continuum_gateway_slot_requests", "Requests forwarded to llama-server, by slot.", ["slot"]
    )
    busy = gauge(
        "continuum_gateway_slot_busy",
        "Requests in flight on each slot (0 or 1 when minds keep to one at a time).",
        ["slot"],
    )
    busy_seconds = counter(
        "continuum_gateway_slot_busy_seconds", "Seconds each slot spent serving requests.", ["slot"]
    )
    tokens = counter(
        "continuum_gateway_slot_tokens",
        "Tokens each slot evaluated (prompt) and generated (predicted).",
        ["slot", "kind"],
    )
    capped = counter(
        "continuum_gateway_capped_requests",
        "Requests whose n_predict was cut to fit the grant.",
        ["slot"],
    )
    turns_cut = counter(
        "continuum_gateway_turns_cut",
        "Turns the gateway cut because the grant was no longer held, by grant reason.",
        ["reason"],
    )
    releases = counter(
        "continuum_gateway_slot_releases",
        "Reclaimed slots erased and reported released, by grant reason.",
        ["reason"],
    )
    parks = counter(
        "continuum_gateway_parks",
        "Reclaimed slots saved to the park store before their erase.",
    )
    park_skips = counter(
        "continuum_gateway_park_skips",
        "Reclaimed slots erased without a park, by why (NoTime, TooLarge, ...).",
        ["reason"],
    )
    park_drops = counter(
        "continuum_gateway_park_drops",
        "Parked contexts deleted unrestored, by why (Evicted, MindGone, ShapeChanged, ...).",
        ["reason"],
    )
    resumes = counter(
        "continuum_gateway_resumes",
        "Parked contexts restored into a mind's slot at her next grant.",
    )
    restored_tokens = counter(
        "continuum_gateway_restored_tokens", "Tokens of parked contexts restored."
    )
    parked_bytes = gauge(
        "continuum_gateway_parked_bytes", "Bytes in the park store, per mind.", ["mind"]
    )
    parked_contexts = gauge(
        "continuum_gateway_parked_contexts", "Contexts in the park store of this engine."
    )
    parked_total_bytes = gauge(
        "continuum_gateway_park_store_bytes", "Bytes in the park store of this engine."
    )
    ready = gauge("continuum_engine_ready", "1 while llama-server answers /health.")
    restarts = counter("continuum_engine_restarts", "Times llama-server was started again.")
    layers_offloaded = gauge(
        "continuum_engine_layers_offloaded", "Layers llama.cpp reports offloaded to the device."
    )
    estimate_error = gauge(
        "continuum_engine_estimate_error_ratio",
        "(planned - allocated) / allocated bytes, per pool side, from the load's receipt.",
        ["pool"],
    )

    def refused(self, reason: Refusal) -> None:
        self.refusals.labels(reason.value).inc()

    def _slot(self, family: str, slot: int, kind: str = "") -> Any:
        """The series of `family` for `slot` (and `kind`), made at its first use."""
        key = (family, slot, kind)
        series = self._by_slot.get(key)
        if series is None:
            labels = (str(slot), kind) if kind else (str(slot),)
            series = self._by_slot[key] = getattr(self, family).labels(*labels)
        return series

    def forwarded(self, slot: int, *, capped: bool) -> None:
        self._slot("requests", slot).inc()
        if capped:
            self._slot("capped", slot).inc()

    def slot_busy(self, slot: int, delta: int) -> None:
        self._slot("busy", slot).inc(delta)

    def slot_busy_for(self, slot: int, seconds: float) -> None:
        self._slot("busy_seconds", slot).inc(max(0.0, seconds))

    def slot_served(self, slot: int, seconds: float, prompt: int, predicted: int) -> None:
        self.slot_busy_for(slot, seconds)
        self._slot("tokens", slot, "prompt").inc(max(0, prompt))
        self._slot("tokens", slot, "predicted").inc(max(0, predicted))

    def turn_cut(self, reason: str) -> None:
        self.turns_cut.labels(reason).inc()

    def slot_released(self, reason: str) -> None:
        self.releases.labels(reason).inc()

    def parked(self, tokens: int, n_bytes: int) -> None:
        self.parks.inc()

    def park_skipped(self, reason: str) -> None:
        self.park_skips.labels(reason).inc()

    def park_dropped(self, reason: str) -> None:
        self.park_drops.labels(reason).inc()

    def resumed(self, tokens: int) -> None:
        self.resumes.inc()
        self.restored_tokens.inc(max(0, tokens))

    def parked_now(self, by_mind: dict[str, int]) -> None:
        """The store as it is: each parked mind's bytes (a mind no longer parked removed)."""
        for mind in self.parked_minds - set(by_mind):
            self.parked_bytes.remove(mind)
        for mind, n in by_mind.items():
            self.parked_bytes.labels(mind).set(n)
        self.parked_minds = set(by_mind)
        self.parked_contexts.set(len(by_mind))
        self.parked_total_bytes.set(sum(by_mind.values()))

    def engine_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def engine_restarted(self) -> None:
        self.restarts.inc()

    def load_reported(self, layers_offloaded: int | None, errors: dict[str, float]) -> None:
        if layers_offloaded is not None:
            self.layers_offloaded.set(layers_offloaded)
        for pool, ratio in errors.items():
            self.estimate_error.labels(pool).set(ratio)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
