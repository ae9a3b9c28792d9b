"""The grant lines of the transition log (docs/transition-log.md), as dicts ready for JSON.

One writer for both authors of the log, the operator (`kube.ledger.grant_ledger`) and the simulator
(`core.simulate`), so that `continuum check-log` reads the same lines from either. Pure: the
step's time is passed in.
"""

from __future__ import annotations

from typing import Any

from continuum_operator.core.grants import Capacity, Transition

__all__ = ["capacity_line", "transition_line"]


def capacity_line(t: float, engine: str, capacity: Capacity) -> dict[str, Any]:
    """`capacity`: the engine's pool as it serves from `t` (its target size is not logged)."""
    return {
        "t": t,
        "engine": engine,
        "event": "capacity",
        "phase": capacity.phase.value,
        "slots": capacity.slots,
        "tokensPerSlot": capacity.tokens_per_slot,
    }


def transition_line(t: float, engine: str, tr: Transition) -> dict[str, Any]:
    """`transition`: one mind's grant changes state at `t`."""
    return {
        "t": t,
        "engine": engine,
        "event": "transition",
        "mind": tr.mind,
        "from": tr.from_state.value if tr.from_state is not None else None,
        "to": tr.to_state.value,
        "reason": tr.reason.value,
        "by": tr.by,
        "tokens": tr.tokens,
        "slot": tr.slot,
        "priority": tr.priority,
        "protectionWindow": tr.protection_window,
        "deadline": tr.deadline,
    }
