"""A TokenQuota holds when one engine's ledger is decided again within a pass: at a further
grace deadline (`GrantsLoop._write_due`) or after a conflict (`LedgerWriter.write`).

Found by review: both decided again within the quota room computed at the engine's first
decision, though engines decided after it had since assumed grants of the namespace, so one
operator took a namespace past its quota (docs/tenancy.md: engines granting side by side
cannot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.builders import ledger_path, stored_ledger
from tests.support.grants_world import BASE, World, engine, mind, quota


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def held(w: World, ns: str) -> dict[str, int]:
    """Tokens each Mind of `ns` holds on the shared engines."""
    return {
        e["mind"]: e["tokens"]
        for name in ("one", "two")
        for e in stored_ledger(w.api.objects, "shared", name).get("grants") or []
        if e["state"] in ("Granted", "Reclaiming") and e["mind"].startswith(ns + "/")
    }


def deleted(w: World, ns: str, name: str) -> dict[str, Any]:
    """The Mind as stored, now being deleted (a newer version, as its watch event brings)."""
    body = w.api.objects[f"{BASE}/{ns}/minds/{name}"]
    meta = body["metadata"]
    newer = str(int(meta["resourceVersion"]) + 1)
    return {
        **body,
        "metadata": {**meta, "deletionTimestamp": "2026-12-03T06:10:00Z", "resourceVersion": newer},
    }


def test_an_engine_stepped_again_at_its_next_deadline_keeps_the_quota(tmp_path: Path) -> None:
    w = World(tmp_path)
    clock = Clock()
    w.loop.clock = clock
    w.engine(engine("shared", "one", slots=2, allowed=["*"]))
    w.engine(engine("shared", "two", slots=1, allowed=["*"]))
    w.quota(quota("team-x", "tokens", 2000))  # two grants of 1,000
    w.mind(mind("team-y", "a", "one", second=1, engineNamespace="shared"))
    w.mind(mind("team-y", "b", "one", second=2, engineNamespace="shared"))
    w.loop.pass_once()
    clock.now = 1_010.0
    w.mind(deleted(w, "team-y", "a"))  # reclaimed: grace deadline 1,040
    w.loop.pass_once()
    clock.now = 1_015.0
    w.mind(deleted(w, "team-y", "b"))  # reclaimed: grace deadline 1,045
    w.mind(mind("team-x", "x1", "one", second=3, engineNamespace="shared"))
    w.mind(mind("team-x", "x2", "one", second=4, engineNamespace="shared"))
    w.loop.pass_once()
    assert held(w, "team-x") == {}
    # Both deadlines past: `one` is due, written at the first and stepped again at the second;
    # `two`, decided between, grants x3 from the room `one` left at its first step.
    clock.now = 1_100.0
    w.mind(mind("team-x", "x3", "two", second=5, engineNamespace="shared"))
    w.loop.pass_once()
    assert sum(held(w, "team-x").values()) <= 2000, held(w, "team-x")


def test_a_ledger_decided_again_after_a_conflict_keeps_the_quota(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("shared", "one", slots=1, allowed=["*"]))
    w.engine(engine("shared", "two", slots=1, allowed=["*"]))
    w.quota(quota("team-x", "tokens", 1000))  # one grant
    w.mind(mind("team-y", "y", "one", second=1, engineNamespace="shared"))
    w.loop.pass_once()
    w.mind(mind("team-x", "x1", "one", second=3, engineNamespace="shared"))
    w.loop.pass_once()  # x1 queued behind y on `one`; `two` is free

    def release_y(obj: dict[str, Any]) -> None:
        obj["status"]["grants"] = [e for e in obj["status"]["grants"] if e["mind"] != "team-y/y"]

    # Another writer (a leader handing over) releases y, who is gone: `one`'s next write is
    # refused (409) and decided again, after `two` has granted x2.
    w.api.meanwhile(ledger_path("shared", "one"), release_y)
    w.cache.observe_mind(w.api.objects.pop(f"{BASE}/team-y/minds/y"), deleted=True, nudge=False)
    w.mind(mind("team-x", "x2", "two", second=4, engineNamespace="shared"))
    w.mind(mind("team-z", "z", "one", second=5, engineNamespace="shared"))
    w.loop.pass_once()
    w.loop.pass_once()
    assert len(held(w, "team-x")) == 1, held(w, "team-x")  # 1,000 tokens each
