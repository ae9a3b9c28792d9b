"""GrantLedgers on the fake API server, for the tests of the engine's grant source."""

from __future__ import annotations

from typing import Any

from continuum_operator.model.grant_ledger import GrantLedger

NAME = "coder"


CAPACITY = {"phase": "Serving", "slots": 2, "tokensPerSlot": 2048}


LEDGERS = GrantLedger.PLURAL


def ledger(status: dict[str, Any] | None, owner: str = "u-1") -> dict[str, Any]:
    meta = {"name": NAME, "ownerReferences": [{"kind": "Engine", "name": NAME, "uid": owner}]}
    return {"kind": GrantLedger.KIND, "metadata": meta, **({"status": status} if status else {})}
