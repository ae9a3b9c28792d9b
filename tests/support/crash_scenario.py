"""The grants operator killed at a crash point and restarted (docs/crash-points.md): the points
(`CRASH_POINTS`), the scenario run across a crash (`scenario`) and the ledger its successor must
settle on (`settled`)."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.cluster import Cluster
from tests.support.grant_ledger import grant_of, states
from tests.support.mind_specs import mind
from tests.support.waiting import wait_for

CRASH_POINTS = [
    "leader-acquired",
    "before-ledger-write",
    "after-ledger-write",
    "after-log",
    "mid-projections",
    "before-finalizer-removal",
]


def scenario(
    cluster: Cluster, ns: str, classes: dict[str, str], crashed: Callable[[], bool]
) -> None:
    """Three low minds on two slots, a high one preempting, a granted one deleted. Each step
    waits until the ledger shows the one before (or the operator has crashed): with fixed
    sleeps a loaded machine started the operator leading after the whole scenario was applied,
    in fewer steps than the crash point counts on."""
    low, high = classes["low"], classes["high"]
    cluster.apply([mind("a", low), mind("b", low), mind("c", low)], "-n", ns)
    wait_for("a, b and c in the ledger", lambda: crashed() or len(states(cluster, ns)) == 3)
    cluster.apply(mind("vip", high), "-n", ns)
    wait_for("vip in the ledger", lambda: crashed() or "vip" in states(cluster, ns))
    cluster.kubectl("delete", "mind", "a", "-n", ns, "--wait=false")


def settled(cluster: Cluster, ns: str) -> Callable[[], bool]:
    def probe() -> bool:
        gone = cluster.kubectl("get", "mind", "a", "-n", ns, check=False).returncode != 0
        want = {"b": "Granted", "c": "Queued", "vip": "Granted"}
        if not gone or states(cluster, ns) != want:
            return False
        return all(grant_of(cluster, ns, m).get("state") == s for m, s in want.items())

    return probe
