"""An embed lane's Prometheus metrics, behind small recorder functions.

Each `LaneRuntime` owns a registry (tests run several in one process), served at `/metrics`
on the lane's own port beside `/v1/embeddings`, as the engine gateway serves its own. Series
carry no lane label: the chart's PodMonitor adds `namespace` and `lane` from the pod. What
they count is also in the EmbedLane's `status.runtime` (`requests`, `largestContextTokens`),
which is written at most every few seconds; these are current at every scrape.
docs/metrics.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from continuum_operator.core.embed import LaneReason
from continuum_operator.metric_families import MetricSet, counter, gauge

__all__ = ["CONTENT_TYPE_LATEST", "REFUSALS", "LaneMetrics"]

#: Why a lane refuses a request: the admission's reasons, and `Calibrating` before its first
#: pass. Each is present from the start at 0, so a rate of refusals needs no absent series.
REFUSALS = (
    "Calibrating",
    LaneReason.CONTEXT_TOO_LARGE.value,
    LaneReason.NOT_PLACED.value,
    LaneReason.POOL_BUSY.value,
)


@dataclass
class LaneMetrics(MetricSet):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    served = counter("continuum_lane_requests_served", "Embedding requests the lane answered.")
    inputs = counter("continuum_lane_inputs_embedded", "Inputs (texts) embedded: one vector each.")
    tokens = counter("continuum_lane_tokens_embedded", "Tokens of the inputs embedded.")
    waited = counter(
        "continuum_lane_requests_waited",
        "Requests that waited for a larger lease before they were served or refused.",
    )
    refusals = counter(
        "continuum_lane_refusals",
        "Requests the lane refused, by reason.",
        ["reason"],
        present=[[reason] for reason in REFUSALS],
    )
    largest = gauge(
        "continuum_lane_largest_context_tokens",
        "The largest context the lane has embedded (its floor in the pool).",
    )
    context = gauge(
        "continuum_lane_context_tokens", "The context the lane holds now (llama.cpp cells)."
    )
    leased = gauge(
        "continuum_lane_leased_context_tokens",
        "The context the lane's lease (status.placement) holds room for.",
    )

    def served_request(self, inputs: int, tokens: int, largest: int, context: int) -> None:
        self.served.inc()
        self.inputs.inc(inputs)
        self.tokens.inc(tokens)
        self.set_context(largest, context)

    def waited_request(self) -> None:
        self.waited.inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def set_context(self, largest: int, context: int) -> None:
        self.largest.set(largest)
        self.context.set(context)

    def set_leased(self, tokens: int) -> None:
        self.leased.set(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
