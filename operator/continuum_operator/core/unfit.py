"""Why an Engine fits no node, summarised as kube-scheduler summarises: counts, not a list.

`core.bestfit.choose` returns a verdict for every node it looked at. At fleet size that list
cannot go into a condition: 1,000 nodes made a 369 KB message, written into two conditions and
rewritten on every board change, close to etcd's request limit for the Engine. `explain` makes
the one message the operator writes (the Unschedulable and Ready conditions, and the Warning
event the transition posts) and `continuum place` prints: the verdicts grouped by why, biggest
group first, each with a few of its nodes, and the closest node with its own reason in full
(what it lacks and what to change), kept under `MAX_MESSAGE_BYTES` whatever the fleet:

    no node has room: 0/1000 nodes fit: 640 with too little memory (closest: gpu-0417, 4,090
    MiB short), 300 with a stale board, its node Lease expired (gpu-0001, gpu-0002, gpu-0003,
    ...), 60 not matching spec.placement.nodeSelector (...). Closest gpu-0417: 16 mind(s) of
    131072 tokens at offload 81/81 need ...; node gpu-0417 has ... Lower spec.minds.min, ...

The node-by-node verdicts are `continuum place`'s (`reasons` in its JSON), offline, from the same
`choose`. Pure. Neighbours: `core.bestfit` (the verdicts), `core.conditions` (the reasons),
`kube.engines.reconcile` and `cli_place` (the two callers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from continuum_operator.core import conditions as cond
from continuum_operator.core.bestfit import Decision, Exclusion, NodeVerdict
from continuum_operator.core.plan import ReasonCode

__all__ = ["MAX_MESSAGE_BYTES", "Group", "Unfit", "explain", "summarise", "why_of"]

#: The most bytes an unschedulable message takes (UTF-8), whatever the number of nodes.
MAX_MESSAGE_BYTES = 1000
#: Nodes named per group (the closest is named besides).
EXAMPLES = 3

# What each group says, count first ("640 with too little memory"), as kube-scheduler's do.
_PHRASES: Mapping[str, str] = {
    Exclusion.NO_NODE: "with a board but no Node object",
    Exclusion.SELECTOR_MISMATCH: "not matching spec.placement.nodeSelector",
    Exclusion.NODE_POOL_MISMATCH: "not in spec.placement.nodePool",
    Exclusion.BOARD_STALE: "with a stale board, its node Lease expired",
    Exclusion.BACKING_OFF: "backed off, an engine pod never started there",
    Exclusion.MPS_ONE_GPU: "sharing their GPUs by MPS, one GPU to a pod, not spec.placement.gpus",
    ReasonCode.INSUFFICIENT_MEMORY: "with too little memory",
    ReasonCode.OFFLOAD_DOES_NOT_FIT: "with too little device memory for spec.offload",
    ReasonCode.NOT_ENOUGH_GPUS: "with too few GPUs for spec.placement.gpus",
    ReasonCode.NO_HOST_POOL: "with no host pool on its board",
    ReasonCode.NO_DISK_POOL: "with no disk pool on its board for spec.park",
    ReasonCode.INSUFFICIENT_DISK: "with too little disk for spec.park",
}


@dataclass(frozen=True, slots=True)
class Group:
    """Nodes left out for the same reason: an `Exclusion`, or the plan's last reason code."""

    why: str
    nodes: tuple[str, ...]

    @property
    def phrase(self) -> str:
        return _PHRASES.get(self.why, f"unschedulable ({self.why})")


@dataclass(frozen=True, slots=True)
class Unfit:
    """Why no node takes the Engine: the condition's reason and message, the groups, and the
    closest node (the smallest shortfall of those planned; None when none was planned)."""

    reason: cond.Reason
    message: str
    groups: tuple[Group, ...]
    closest: NodeVerdict | None

    @property
    def problem(self) -> cond.Problem:
        return cond.Problem(self.reason, self.message)


def why_of(v: NodeVerdict) -> str:
    """A verdict's group: its exclusion, or for a node planned and found unschedulable the
    plan's last reason (the one that decided)."""
    return v.why


def _mib(n: int) -> str:
    return f"{-(-n // 2**20):,} MiB"  # rounded up: 1 byte short is 1 MiB short, not 0


def _fit(text: str, limit: int) -> str:
    """`text` cut to `limit` UTF-8 bytes, an ellipsis marking the cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - len("...")].decode(errors="ignore") + "..."


def _lead(kinds: set[Exclusion | None]) -> tuple[cond.Reason, str]:
    if kinds <= {
        Exclusion.SELECTOR_MISMATCH,
        Exclusion.NODE_POOL_MISMATCH,
        Exclusion.NO_NODE,
        Exclusion.MPS_ONE_GPU,
    }:
        return cond.Reason.NO_MATCHING_NODE, "no node with a board matches spec.placement"
    if Exclusion.UNSCHEDULABLE in kinds:
        return cond.Reason.INSUFFICIENT_MEMORY, "no node has room"
    if Exclusion.BACKING_OFF in kinds:
        return cond.Reason.POD_NEVER_STARTED, "engine pods did not start"
    return cond.Reason.NO_FRESH_BOARD, "no matching node has a fresh board"


def summarise(decision: Decision) -> Unfit:
    """Why `decision` chose no node, as the operator's conditions say it (see the module)."""
    # Each node's group, and the closest node's verdict: not every node's verdict, which a
    # pre-filtered decision would plan node by node (`core.bestfit.Decision`).
    whys = decision.whys()
    if not whys:
        return Unfit(
            cond.Reason.NO_BOARDS,
            "no node has a NodeBoard yet (is the node agent running?)",
            (),
            None,
        )
    by_why: dict[str, list[str]] = {}
    for node, _, why in whys:
        by_why.setdefault(why, []).append(node)
    groups = tuple(
        Group(why, tuple(sorted(nodes)))
        for why, nodes in sorted(by_why.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    closest = decision.closest()
    reason, lead = _lead({excluded for _, excluded, _ in whys})
    fitting = sum(1 for _, excluded, _ in whys if excluded is None)

    def counts(examples: int) -> str:
        parts = []
        for g in groups:
            named: list[str] = []
            if closest is not None and closest.node in g.nodes:
                short = closest.plan.shortfall_bytes if closest.plan is not None else None
                named.append(
                    f"closest: {closest.node}" + (f", {_mib(short)} short" if short else "")
                )
            else:
                named.extend(g.nodes[:examples])
                if examples and len(g.nodes) > examples:
                    named.append("...")
            shown = f" ({', '.join(named)})" if named else ""
            parts.append(f"{len(g.nodes)} {g.phrase}{shown}")
        return f"{lead}: {fitting}/{len(whys)} nodes fit: " + ", ".join(parts)

    detail = f". Closest {closest.node}: {closest.message}" if closest is not None else ""
    head = counts(EXAMPLES)
    if len((head + detail).encode()) > MAX_MESSAGE_BYTES:
        head = counts(0)  # the closest stays named; the groups' examples go
    room = MAX_MESSAGE_BYTES - len(head.encode())
    message = (
        head + _fit(detail, room) if room > len(". Closest ...") else _fit(head, MAX_MESSAGE_BYTES)
    )
    return Unfit(reason, message, groups, closest)


def explain(decision: Decision) -> cond.Problem:
    """The Unschedulable condition's reason and message for a decision that chose no node."""
    return summarise(decision).problem
