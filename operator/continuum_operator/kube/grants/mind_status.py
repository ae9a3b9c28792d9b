"""A Mind's `status.grant` and conditions, projected from her entry in her Engine's ledger (or
from why she is not in one). No API calls. Neighbours: `kube.ledger.grant_ledger` (the entries),
`kube.grants.loop` (writes the projection when it differs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from continuum_operator.core.grants import REFUSALS, GrantReason
from continuum_operator.kube.ledger.routing import Refused, RouteReason
from continuum_operator.model.grant import GrantEntry, iso_micro
from continuum_operator.model.json_body import integer, items_at, text
from continuum_operator.model.mind import GrantProjection, GrantState, ProjectedState

__all__ = [
    "MindConditionType",
    "Projection",
    "engine_not_found",
    "parked_of",
    "place_in_line",
    "projection",
    "refused_projection",
]

# Queue reasons that are the engine's, not the pool's: the projection says why it is not serving.
_ENGINE_WAITS = frozenset(
    {GrantReason.ENGINE_RELAUNCHING, GrantReason.ENGINE_STARTING, GrantReason.ENGINE_UNSCHEDULABLE}
)


# Refusals for what she asks (her ContextTooLarge condition is True), not for who she is.
_SIZE_REFUSALS = frozenset({GrantReason.CONTEXT_TOO_LARGE, GrantReason.CLASS_LIMIT})


class MindConditionType(StrEnum):
    GRANTED = "Granted"
    CONTEXT_TOO_LARGE = "ContextTooLarge"


#: The ContextTooLarge condition of a Mind whose ask fits (or who asks nothing yet).
FITS = (False, "Fits", "")

#: A condition as projected: its status, reason and message, by condition type.
Conditions = Mapping[str, tuple[bool, str, str]]


@dataclass(frozen=True, slots=True)
class Projection:
    """What the operator says in a Mind's status: her `status.grant` (None: the ledger does not
    hold her), her conditions, and the address her turns are served at (None: no engine)."""

    grant: GrantProjection | None
    conditions: Conditions
    endpoint: str | None = None
    #: Her context in the engine's park store (`{tokens, bytes}`), None: none parked.
    parked: dict[str, int] | None = None

    def at(self, endpoint: str | None, parked: dict[str, int] | None = None) -> Projection:
        return replace(self, endpoint=endpoint, parked=parked)


def parked_of(engine: Mapping[str, object]) -> dict[str, dict[str, int]]:
    """Each mind's parked context as the engine's runtime reports its park store
    (`status.runtime.park.minds`): `{tokens, bytes}` by mind."""
    out: dict[str, dict[str, int]] = {}
    for m in items_at(engine, "status", "runtime", "park", "minds"):
        if (mind := text(m, "mind")) is not None:
            out[mind] = {"tokens": integer(m, "tokens") or 0, "bytes": integer(m, "bytes") or 0}
    return out


def place_in_line(position: object) -> str:
    """A queued Mind's place, rounded up to 1, 2 or 5 of a power of ten: when the queue moves
    up one, only the minds crossing such a bound see a change, so a step rewrites about three
    Minds' status a decade of the queue rather than every queued one's (as many status writes
    as minds queued behind, at each move, before). Her exact place is in her Engine's
    `status.grants` (the head of the queue) and in the gateway's answers."""
    if not isinstance(position, int) or position < 1:
        return "in line"
    if position <= 2:
        return ("first", "second")[position - 1] + " in line"
    decade = 1
    while True:
        for step in (2, 5, 10):
            if position <= step * decade:
                return f"among the first {step * decade:,} in line"
        decade *= 10


def projection(
    entry: GrantEntry | None,
    engine: str,
    slot_tokens: int,
    asked: int,
    *,
    class_note: str = "",
    quota_note: str = "",
    engine_note: str = "",
    namespace_note: str = "",
) -> Projection:
    """A Mind's `status.grant` from her ledger entry, and her conditions (type -> status,
    reason, message); no endpoint (the writer knows it). The grant is None when the ledger
    does not (or no longer) hold her. `class_note` names her class and its limit (for
    `ClassLimit`); `quota_note` her namespace's quota, its use and limit (for
    `QuotaExceeded`); `engine_note` why the engine is not serving (for the reasons a queue
    waits on the engine with); `namespace_note` her class and the namespaces it allows (for
    `ClassNotAllowed`).

    A refusal is `Released` in the ledger (the allocator's state table) but `Refused` in her
    projection: she was never granted, and `kubectl get minds` should not say she was."""
    if entry is None:
        absent = (False, "NotInLedger", f"not in Engine {engine}'s ledger")
        return Projection(
            None, {MindConditionType.GRANTED: absent, MindConditionType.CONTEXT_TOO_LARGE: FITS}
        )
    state = entry.state
    reason = entry.reason.value if entry.reason is not None else ""
    if state == GrantState.GRANTED:
        message = f"slot {entry.slot} of Engine {engine}, {entry.tokens} tokens"
    elif state == GrantState.RECLAIMING:
        by = f" by {entry.by}" if entry.by else ""
        deadline = entry.deadline
        when = f", released by {iso_micro(deadline)}" if deadline is not None else ""
        message = f"being reclaimed ({reason}{by}): the turn ends now{when}"
    elif state == GrantState.QUEUED and reason == GrantReason.QUOTA_EXCEEDED:
        message = (
            f"queued (QuotaExceeded), {place_in_line(entry.position)}: {quota_note}; "
            "she is granted when the namespace's minds release enough tokens, or raise the "
            "TokenQuota's spec.maxTokens"
        )
    elif state == GrantState.QUEUED and reason in _ENGINE_WAITS:
        why = f": {engine_note}" if engine_note else ""
        message = (
            f"queued ({reason}), {place_in_line(entry.position)}: Engine {engine} is "
            f"not serving{why}"
        )
    elif state == GrantState.QUEUED:
        message = f"queued ({reason}), {place_in_line(entry.position)}"
    else:
        message = _refusal_message(reason, engine, slot_tokens, asked, class_note, namespace_note)
    refused = state == GrantState.RELEASED and reason in REFUSALS
    too_large = refused and reason in _SIZE_REFUSALS
    grant = GrantProjection(
        state=ProjectedState.REFUSED if refused else ProjectedState(state.value),
        tokens=entry.tokens,
        slot=entry.slot,  # None: removed by the merge patch
        since=entry.since,
        reason=reason,
        message=message,
    )
    conditions: dict[str, tuple[bool, str, str]] = {
        MindConditionType.GRANTED: (state == GrantState.GRANTED, reason, message),
        MindConditionType.CONTEXT_TOO_LARGE: (
            too_large,
            reason if too_large else "Fits",
            message if too_large else "",
        ),
    }
    return Projection(grant, conditions)


def _refusal_message(
    reason: str, engine: str, slot_tokens: int, asked: int, class_note: str, namespace_note: str
) -> str:
    """What a refused (or released) Mind's status says: why, and what to do."""
    if reason == GrantReason.CONTEXT_TOO_LARGE:
        return (
            f"asks {asked} tokens but a slot of Engine {engine} holds {slot_tokens}; "
            "lower spec.contextTokens or raise the Engine's contextTokensPerMind"
        )
    if reason == GrantReason.CLASS_LIMIT:
        return (
            f"asks {asked} tokens but {class_note}; lower spec.contextTokens, or name a class "
            "that allows more in spec.className"
        )
    if reason == GrantReason.CLASS_NOT_ALLOWED:
        return (
            f"{namespace_note or 'her MindClass does not allow her namespace'}. Name a class her "
            "namespace may use in spec.className, or ask a cluster admin to add it to the "
            "MindClass spec.allowedNamespaces"
        )
    return reason


def engine_not_found(key: tuple[str, str]) -> Refused:
    """Why a Mind naming an Engine that does not exist holds nothing."""
    ns, name = key
    return Refused(
        RouteReason.ENGINE_NOT_FOUND,
        f"Engine {ns}/{name} does not exist; create it, or name an existing Engine in "
        "spec.engine (and spec.engineNamespace for another namespace's; kubectl get engines -A)",
    )


def refused_projection(refused: Refused) -> Projection:
    """The projection of a Mind kept out of the allocator: `Refused`, holding nothing, and why
    (in `kubectl get minds` as in her Granted condition)."""
    grant = GrantProjection(
        state=ProjectedState.REFUSED, reason=refused.reason.value, message=refused.message
    )
    return Projection(
        grant,
        {
            MindConditionType.GRANTED: (False, refused.reason.value, refused.message),
            MindConditionType.CONTEXT_TOO_LARGE: FITS,
        },
    )
