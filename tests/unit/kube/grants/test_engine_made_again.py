"""An Engine deleted and made again under its name (docs/grants.md, "A stale ledger is replaced,
never read"), as the transition log tells it.

Found by review: the log named an engine by namespace/name alone and a new GrantLedger counts
its steps from 1 again, so (1) the old ledger's holders stayed Granted in the log and
`check-log` flagged the new Engine's first grant, and (2) a leader killed between the new
ledger's first write and its log append left a step the next leader took for logged. The
operator's lines now name their GrantLedger (`ledger`, its uid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from continuum_operator import checklog
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.grants.loop import GrantsLoop
from tests.support.builders import ledger_path
from tests.support.grants_world import BASE, World, engine, mind


def log_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if x]


def made(uid: str) -> dict[str, Any]:
    body = engine("team-a", "coder", slots=1)
    body["metadata"]["uid"] = uid
    return body


def granted_then_made_again(tmp_path: Path) -> World:
    w = World(tmp_path)
    w.engine(made("engine-1"))
    w.mind(mind("team-a", "ann", "coder", second=1))
    w.loop.pass_once()  # seq 1: ann granted slot 0
    w.mind(mind("team-a", "bob", "coder", second=2))
    w.loop.pass_once()  # seq 2: bob queued
    # The Engine deleted; the garbage collector deletes its GrantLedger with it.
    body = w.api.objects.pop(f"{BASE}/team-a/engines/coder")
    w.engines.observe_engine(body, deleted=True, nudge=False)
    ledger = w.api.objects.pop(ledger_path("team-a", "coder"))
    w.engines.observe_ledger(ledger, deleted=True, nudge=False)
    w.loop.pass_once()
    w.engine(made("engine-2"))  # made again under the same name
    return w


def test_an_engine_made_again_under_its_name_leaves_a_log_check_log_finds_clean(
    tmp_path: Path,
) -> None:
    w = granted_then_made_again(tmp_path)
    w.loop.pass_once()  # the new Engine's first step: ann granted again
    lines = log_lines(tmp_path)
    assert checklog.check(lines) == []
    assert len({x["ledger"] for x in lines}) == 2  # each line names its GrantLedger


def test_a_step_of_a_ledger_made_again_is_recovered_by_the_next_leader(tmp_path: Path) -> None:
    w = granted_then_made_again(tmp_path)
    w.loop.log.append = lambda engine, seq, lines: None  # type: ignore[method-assign]
    w.loop.pass_once()  # the new ledger's seq 1 written; the leader dies before the append
    assert w.api.objects[ledger_path("team-a", "coder")]["status"]["grantStep"]["seq"] == 1
    settings = GrantSettings(transition_log=tmp_path / "log.jsonl", write_workers=2)
    w.loop = GrantsLoop(w.api.aio, settings, w.engines, w.cache, clock=lambda: 1_000.0)  # type: ignore[arg-type]
    w.loop.pass_once()  # a new leader: recovers every journal the log lacks
    ann = [x for x in log_lines(tmp_path) if x.get("mind") == "team-a/ann" and x["to"] == "Granted"]
    assert len(ann) == 2, "the new ledger's journaled step was never appended to the log"
    assert checklog.check(log_lines(tmp_path)) == []
