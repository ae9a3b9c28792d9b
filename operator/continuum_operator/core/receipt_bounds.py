"""How far a receipt may stand from the estimate of its own placement and still be planned from.

A receipt is evidence, not a command (docs/receipts.md, "Bounded by the estimate"). Its writers
include the engine's own pod (`status.runtime.receipts`) and whoever hands `continuum plan` a
file; a receipt of 1-byte buffers would have a plan grant many times the minds the node holds
and charge a device a sliver of what it will hold. The estimate is arithmetic on the model file
(`core.plan`), which nobody but the file's writer moves, so a receipt is checked against it,
part by part and side by side, and one beyond the bound is not planned from: the estimate
stands and the plan (and the Engine's `ReceiptRefused` condition) says why.

The bound, per side (device, host) and part, with the estimate E of the same offload level and
minds:

| part | the receipt may be | why so wide or so narrow |
|---|---|---|
| weights | 0.9 E to 1.1 E | the GGUF's tensor sizes are exact; every load measured matched |
| KV (and recurrent state) | 0.75 E to 4 E | exact arithmetic; a recurrent state is not estimated |
| compute (and output) | 0.25 E to 4 E | the graph estimate is a cover (37 MiB measured for 71.5) |

each widened by `SLACK_BYTES` either way, so that parts of a few MiB (a tiny model, llama.cpp's
device graph where nothing is offloaded) are not judged by ratios of rounding. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["BOUNDS", "SLACK_BYTES", "Bound", "out_of_bounds"]

MIB = 1 << 20
SLACK_BYTES = 64 * MIB


@dataclass(frozen=True, slots=True)
class Bound:
    low: float
    high: float

    def holds(self, measured: int, estimate: int) -> bool:
        return self.low * estimate - SLACK_BYTES <= measured <= self.high * estimate + SLACK_BYTES

    def text(self) -> str:
        return f"{self.low:g}x to {self.high:g}x the estimate, {SLACK_BYTES // MIB} MiB either way"


BOUNDS: Mapping[str, Bound] = {
    "weights": Bound(0.9, 1.1),
    "kv": Bound(0.75, 4.0),
    "compute": Bound(0.25, 4.0),
}


def out_of_bounds(
    measured: Mapping[str, Mapping[str, int]], estimate: Mapping[str, Mapping[str, int]]
) -> str | None:
    """The first part, by side, whose measured bytes are beyond the bound of the estimate's,
    said in words; None when every part is within it. Both: side ("device", "host") -> part
    ("weights", "kv", "compute") -> bytes."""
    for side in ("device", "host"):
        for part, bound in BOUNDS.items():
            got = int(measured.get(side, {}).get(part, 0))
            want = int(estimate.get(side, {}).get(part, 0))
            if not bound.holds(got, want):
                return (
                    f"its {side} {part} is {got / MIB:,.1f} MiB where the estimate is "
                    f"{want / MIB:,.1f} MiB, beyond the bound ({bound.text()})"
                )
    return None
