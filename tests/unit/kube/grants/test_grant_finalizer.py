"""The grant finalizer when the API server puts it on every Mind at her creation (the chart's
MutatingAdmissionPolicy, charts/continuum/templates/mind-grant-finalizer-policy.yaml): the
operator writes no finalizer when she is granted (a grant is two writes, not three), and takes
it off a Mind deleted while queued, who held nothing, once she has left the ledger."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from continuum_operator.kube.grants.mind_writes import FINALIZER
from tests.support.grants_world import BASE, World, engine, mind


def with_finalizer(body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["finalizers"] = [FINALIZER]  # as the policy puts it, at creation
    return body


def finalizer_writes(w: World, since: int) -> list[str]:
    return [
        c.path.rsplit("/", 1)[-1]
        for c in w.api.calls[since:]
        if c.method == "PATCH" and "finalizers" in str(c.body)
    ]


def test_a_mind_who_already_carries_the_finalizer_is_granted_without_a_finalizer_write(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=1))
    for name, second in (("ada", 1), ("bea", 2)):
        w.mind(with_finalizer(mind("team-a", name, "coder", second=second)))
    w.loop.pass_once()
    assert w.ledger("team-a", "coder") == {
        "team-a/ada": ("Granted", "SlotFree"), "team-a/bea": ("Queued", "PoolFull")
    }  # fmt: skip
    assert finalizer_writes(w, 0) == []  # before: one, ada's, when she was granted
    # Bea, queued, is deleted: she held nothing; once out of the ledger her finalizer comes off.
    path = f"{BASE}/team-a/minds/bea"
    deleting = copy.deepcopy(w.api.objects[path])
    deleting["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:00Z"
    w.api.objects[path] = deleting
    w.cache.observe_mind(deleting, deleted=False, nudge=False)
    before = len(w.api.calls)
    w.loop.pass_once()
    w.loop.pass_once()
    assert "team-a/bea" not in w.ledger("team-a", "coder")
    assert finalizer_writes(w, before) == ["bea"]
    assert w.api.objects[f"{BASE}/team-a/minds/ada"]["metadata"]["finalizers"] == [FINALIZER]


def test_a_mind_created_without_it_gets_it_from_the_operator_when_granted(tmp_path: Path) -> None:
    # Where the policy is off (or the API server predates it), as before.
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=1))
    w.mind(mind("team-a", "ada", "coder"))
    w.loop.pass_once()
    assert finalizer_writes(w, 0) == ["ada"]
    assert w.api.objects[f"{BASE}/team-a/minds/ada"]["metadata"]["finalizers"] == [FINALIZER]
