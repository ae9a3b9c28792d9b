"""An Engine's grants on the local control plane, read back: its GrantLedger's entries by mind
(`ledger`, `states`), a Mind's own projection of hers (`grant_of`), the pool serving its slots
(`serving`), and the invariant every run keeps (`assert_no_grant_doubled`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.cluster import Cluster


def ledger(cluster: Cluster, ns: str, name: str = "coder") -> dict[str, dict[str, Any]]:
    status = cluster.ledger_status(ns, name)
    return {e["mind"].split("/", 1)[1]: e for e in status.get("grants") or []}


def states(cluster: Cluster, ns: str, name: str = "coder") -> dict[str, str]:
    return {m: e["state"] for m, e in ledger(cluster, ns, name).items()}


def grant_of(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    body = cluster.get_json("mind", name, "-n", ns)
    return dict((body.get("status") or {}).get("grant") or {})


def serving(cluster: Cluster, ns: str, slots: int, name: str = "coder") -> Callable[[], bool]:
    def probe() -> bool:
        pool = cluster.ledger_status(ns, name).get("grantCapacity") or {}
        return pool.get("phase") == "Serving" and pool.get("slots") == slots

    return probe


def assert_no_grant_doubled(cluster: Cluster, ns: str, name: str = "coder") -> None:
    """The live ledger: each held slot held once, within the pool; each Mind's projection
    agrees with her entry."""
    status = cluster.ledger_status(ns, name)
    pool = status["grantCapacity"]
    held = [e for e in status["grants"] if e["state"] in ("Granted", "Reclaiming")]
    slots = [e["slot"] for e in held]
    assert len(slots) == len(set(slots)), held
    assert all(0 <= s < pool["slots"] for s in slots), (pool, held)
    minds = {m["mind"] for m in status["grants"]}
    assert len(minds) == len(status["grants"])
    for e in status["grants"]:
        projected = grant_of(cluster, ns, e["mind"].split("/", 1)[1])
        # A refusal is Released in the ledger and Refused in her projection (never granted).
        state = "Refused" if e["state"] == "Released" else e["state"]
        assert (projected.get("state"), projected.get("slot")) == (state, e.get("slot"))
