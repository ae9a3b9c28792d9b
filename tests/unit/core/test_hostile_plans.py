"""Plans of specs the schema admits but no node can serve say which field to change
(docs/design.md rule 9; the API server's side is tests/e2e/test_hostile_specs.py)."""

from __future__ import annotations

from typing import Any

from continuum_operator.core.plan import plan
from tests.support.builders import GiB, board, board_body, engine, engine_body


def _discrete(device_gib: int = 80, host_gib: int = 256) -> dict[str, Any]:
    return board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": host_gib * GiB, "usedBytes": 8 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB, "usedBytes": 0},
        ],
    )


def _why(**spec: Any) -> str:
    e = engine(engine_body(**spec))
    assert e.spec.model.facts is not None
    p = plan(board(_discrete()), e.spec, e.spec.model.facts)
    assert not p.schedulable
    return p.reasons[-1].message


def test_a_reserve_larger_than_the_pool_is_named_as_what_to_lower() -> None:
    why = _why(reserveBytes=2**62)
    assert "Lower spec.reserveBytes" in why
    assert "spec.minds.min" not in why


def test_a_spec_that_needs_more_than_the_pool_is_told_to_ask_for_less() -> None:
    why = _why(contextTokensPerMind=16_777_216, minds={"min": 64, "max": 64})
    assert "Lower spec.minds.min, spec.contextTokensPerMind" in why
    assert "spec.reserveBytes" not in why
