"""An Engine's ledger stays bounded whatever the number of minds
(`kube.ledger.grant_ledger.bounded`, docs/grants.md "Bounded"): the object keeps every holder, the
head of the queue and the first refusals, and its journal their lines; the rest is each Mind's own
status and the log's. A new leader takes the rest from the log (or, with none, from the Minds'
status), so the log stays whole across leaders and crashes: `check-log` judges it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import checklog
from continuum_operator.engine.admission import BEYOND_TABLE, Refusal, admit_turn, table_from_ledger
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.grants.loop import GrantsLoop
from continuum_operator.kube.grants.write_queue import Write
from continuum_operator.kube.ledger import grant_ledger
from tests.support.builders import ledger_path
from tests.support.grants_world import BASE, World, engine

MiB = 2**20
ENGINE = f"{BASE}/team-a/engines/coder"
LEDGER = ledger_path("team-a", "coder")


def mind(i: int, cls: str = "") -> dict[str, Any]:
    minute, second = divmod(i, 60)
    return {
        "metadata": {"namespace": "team-a", "name": f"mind-{i:05d}", "resourceVersion": "1",
                     "generation": 1,
                     "creationTimestamp": f"2026-12-03T{6 + minute // 60:02d}:{minute % 60:02d}:"
                                          f"{second:02d}Z"},
        "spec": {"engine": "coder", "contextTokens": 256, **({"className": cls} if cls else {})},
    }  # fmt: skip


class Writes:
    """The GrantLedger status replaces the loop sends, serialised as the Kubernetes client sends
    them (`json.dumps` of the body)."""

    def __init__(self, w: World) -> None:
        self.sizes: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        real = w.api.request

        def request(method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
            if method == "PUT":
                self.sizes.append(len(json.dumps(body).encode()))
                self.bodies.append(body)
            return real(method, path, body, **kw)

        w.api.request = request  # type: ignore[method-assign]


def log_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if x]


def grant_of(w: World, i: int) -> dict[str, Any]:
    return dict(w.status("minds", "team-a", f"mind-{i:05d}")["grant"])


def test_a_ledger_of_20000_minds_on_one_engine_stays_under_1_mib_per_object(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    writes = Writes(w)
    # Of the 20,000 Minds' writes, those of the three read below run (the rest cost time only).
    read = {f"team-a/mind-{i:05d}" for i in (0, 19, 19_999)}
    submit = w.loop.writer.submit

    def only_read(priority: int, key: str, write: Write) -> None:
        if key in read:
            submit(priority, key, write)

    w.loop.writer.submit = only_read  # type: ignore[method-assign]
    w.engine(engine("team-a", "coder", slots=20))
    for i in range(20_000):
        w.mind(mind(i))
    w.loop.pass_once()

    assert writes.sizes and max(writes.sizes) < MiB
    obj = w.api.objects[LEDGER]
    assert len(json.dumps(obj).encode()) < MiB
    status = obj["status"]
    states = [e["state"] for e in status["grants"]]
    assert states.count("Granted") == 20 and states.count("Queued") == grant_ledger.QUEUE_KEPT
    assert status[grant_ledger.QUEUE_FIELD] == {
        "queued": 19_980, "refused": 0, "keptQueued": grant_ledger.QUEUE_KEPT, "keptRefused": 0
    }  # fmt: skip
    # Every mind's place is hers, in her own status (to 1, 2 or 5 of a power of ten, so that
    # a move of the queue rewrites few of them): the first 20 granted, the last one last.
    assert grant_of(w, 0)["state"] == "Granted" and grant_of(w, 19)["state"] == "Granted"
    assert grant_of(w, 19_999)["state"] == "Queued"
    assert grant_of(w, 19_999)["message"].startswith("queued (PoolFull), among the first 20,000")
    assert checklog.check(log_lines(tmp_path)) == []


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds at a size a test can read: 5 queued and 2 refused entries kept."""
    monkeypatch.setattr(grant_ledger, "QUEUE_KEPT", 5)
    monkeypatch.setattr(grant_ledger, "REFUSED_KEPT", 2)


def new_leader(w: World, tmp_path: Path, log: bool = True) -> None:
    """Another replica takes over: the same API and watches (and log, unless `log` is False),
    none of the last one's memory."""
    path = tmp_path / "log.jsonl" if log else None
    settings = GrantSettings(transition_log=path, write_workers=2)
    w.loop = GrantsLoop(w.api.aio, settings, w.engines, w.cache, clock=lambda: 1_000.0)  # type: ignore[arg-type]


def logged(w: World) -> list[dict[str, Any]]:
    """The lines the current leader appends from now on (kept even when it keeps no file)."""
    lines: list[dict[str, Any]] = []
    append = w.loop.log.append

    def capture(engine: str, seq: int, step: Any) -> None:
        lines.extend(step)
        append(engine, seq, step)

    w.loop.log.append = capture  # type: ignore[method-assign,assignment]
    return lines


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize("log", [True, False], ids=["from-the-log", "from-the-minds-status"])
def test_a_new_leader_takes_the_queue_the_object_left_out_from_the_log_or_the_minds(
    tmp_path: Path, log: bool
) -> None:
    w = World(tmp_path)
    writes = Writes(w)
    w.engine(engine("team-a", "coder", slots=2))
    for i in range(12):
        w.mind(mind(i))
    lines = logged(w)
    w.loop.pass_once()
    kept = [e["mind"][-2:] for e in w.api.objects[LEDGER]["status"]["grants"]]
    assert kept == ["00", "01", "02", "03", "04", "05", "06"]
    assert grant_of(w, 11)["message"].startswith("queued (PoolFull), among the first 10 in")
    # Its first pass steps every engine: the five beyond the head are where they were (had it
    # taken them for new, they would have arrived again: a write, and lines).
    new_leader(w, tmp_path, log)
    lines += logged(w)
    w.loop.pass_once()
    assert len(writes.sizes) == 1 and len(lines) == 1 + 24  # the capacity line, 12 x 2
    # The granted leave (reclaimed, then released as the gateway reports), each step decided by
    # a leader that never saw the queue beyond the head: it moves up, as it stood.
    for i in (0, 1):
        delete_mind(w, i)
    new_leader(w, tmp_path, log)
    lines += logged(w)
    w.loop.pass_once()
    body = w.api.objects[ENGINE]
    reclaimed = [e for e in w.api.objects[LEDGER]["status"]["grants"] if e["state"] == "Reclaiming"]
    assert [e["reason"] for e in reclaimed] == ["MindDeleted", "MindDeleted"]
    releases = [{"mind": e["mind"], "slot": e["slot"], "grantSince": e["since"]} for e in reclaimed]
    body["status"]["runtime"] = {"slotReleases": releases}
    body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
    w.engines.observe_engine(body, deleted=False, nudge=False)
    new_leader(w, tmp_path, log)
    lines += logged(w)
    w.loop.pass_once()
    assert grant_of(w, 2)["state"] == "Granted" and grant_of(w, 3)["state"] == "Granted"
    assert grant_of(w, 11)["message"].startswith("queued (PoolFull), among the first 10 in")
    arrivals = [x["mind"] for x in lines if x["event"] == "transition" and x["reason"] == "Arrived"]
    assert sorted(arrivals) == [f"team-a/mind-{i:05d}" for i in range(12)]  # once each
    assert checklog.check(lines) == []
    if log:
        assert checklog.check(log_lines(tmp_path)) == []


def queue_past_the_head_then_kill_the_log(tmp_path: Path) -> World:
    """Two slots and twelve minds decided and logged; from here on, each pass's log append
    never happens (a leader killed at after-ledger-write)."""
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=2))
    for i in range(12):
        w.mind(mind(i))
    w.loop.pass_once()
    w.loop.log.append = lambda engine, seq, lines: None  # type: ignore[method-assign]
    return w


def delete_mind(w: World, i: int) -> None:
    w.api.objects.pop(f"{BASE}/team-a/minds/mind-{i:05d}")
    w.cache.forget(f"team-a/mind-{i:05d}")


def test_when_the_queue_moves_up_one_only_the_minds_whose_place_in_their_status_changed_are_written(
    tmp_path: Path,
) -> None:
    """The head of a queue of 998 leaves: every mind behind her moves up one. Her place in each
    Mind's status is rounded to 1, 2 or 5 of a power of ten, so the step writes the statuses
    of the minds crossing such a bound only (997 writes when it was exact)."""
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=2))
    for i in range(1_000):
        w.mind(mind(i))
    w.loop.pass_once()
    assert grant_of(w, 2)["message"] == "queued (PoolFull), first in line"
    before = len(w.api.calls)
    delete_mind(w, 2)
    w.loop.pass_once()
    written = sorted(
        c.path.split("/")[-2]
        for c in w.api.calls[before:]
        if c.method == "PATCH" and "/minds/" in c.path and c.path.endswith("/status")
    )
    # Positions 2, 3, 6, 11, 21, 51, 101, 201 and 501 move to 1, 2, 5, 10, 20, 50, ...
    assert written == [f"mind-{p + 1:05d}" for p in (2, 3, 6, 11, 21, 51, 101, 201, 501)]
    assert grant_of(w, 3)["message"] == "queued (PoolFull), first in line"
    assert grant_of(w, 999)["message"] == "queued (PoolFull), among the first 1,000 in line"
    assert w.ledger("team-a", "coder")["team-a/mind-00004"] == ("Queued", "PoolFull")


@pytest.mark.usefixtures("small")
def test_a_leader_killed_before_its_log_append_leaves_a_log_the_next_one_keeps_whole(
    tmp_path: Path,
) -> None:
    """The journal holds the kept minds' lines only; what it left out, the next leader decides
    again from the log: minds it never logged arrive, a deleted one it logged queued leaves."""
    w = queue_past_the_head_then_kill_the_log(tmp_path)
    # The pass whose log append never happens: six minds arrive beyond the head, one beyond it
    # is deleted.
    for i in range(12, 18):
        w.mind(mind(i))
    delete_mind(w, 10)
    w.loop.pass_once()
    step = w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]
    assert step["omitted"] == 6 * 2
    assert [(x["mind"], x["reason"]) for x in step["lines"]] == [
        ("team-a/mind-00010", "MindDeleted")
    ]
    new_leader(w, tmp_path)
    w.loop.pass_once()  # recovers the journal (the departure), then decides
    lines = log_lines(tmp_path)
    moves = [(x["mind"][-2:], x["to"], x["reason"]) for x in lines if x["event"] == "transition"]
    assert ("10", "Released", "MindDeleted") in moves
    assert sorted(m for m, _, r in moves if r == "Arrived") == [f"{i:02d}" for i in range(18)]
    assert checklog.check(lines) == []


@pytest.mark.usefixtures("small")
def test_a_queued_mind_deleted_in_a_step_the_log_missed_leaves_the_log_in_that_step(
    tmp_path: Path,
) -> None:
    """A step whose only line is a departure from beyond the object's head: its journal keeps
    that line, so the next leader logs the step under its own seq and the log has no gap."""
    w = queue_past_the_head_then_kill_the_log(tmp_path)
    delete_mind(w, 11)
    w.loop.pass_once()
    step = w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]
    assert [(x["mind"], x["to"], x["reason"]) for x in step["lines"]] == [
        ("team-a/mind-00011", "Released", "MindDeleted")
    ]
    new_leader(w, tmp_path)
    w.loop.pass_once()
    lines = log_lines(tmp_path)
    left = [x for x in lines if x.get("mind") == "team-a/mind-00011" and x["to"] == "Released"]
    assert [x["seq"] for x in left] == [step["seq"]]
    assert checklog.check(lines) == []


@pytest.mark.usefixtures("small")
def test_a_step_of_arrivals_beyond_the_head_only_leaves_its_seq_in_the_log_after_a_crash(
    tmp_path: Path,
) -> None:
    """Every line of the step is of a mind the object does not keep: the journal still keeps
    one, so the log's seqs run without a gap, and every arrival is logged once."""
    w = queue_past_the_head_then_kill_the_log(tmp_path)
    for i in range(12, 15):
        w.mind(mind(i))
    w.loop.pass_once()
    step = w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]
    assert step["omitted"] == 3 * 2 - 1 and len(step["lines"]) == 1
    new_leader(w, tmp_path)
    w.loop.pass_once()
    lines = log_lines(tmp_path)
    seqs = [x["seq"] for x in lines]
    blocks = [q for i, q in enumerate(seqs) if i == 0 or seqs[i - 1] != q]
    assert blocks == list(range(blocks[0], blocks[-1] + 1)) and step["seq"] in blocks
    arrivals = [x["mind"] for x in lines if x["event"] == "transition" and x["reason"] == "Arrived"]
    assert sorted(arrivals) == [f"team-a/mind-{i:05d}" for i in range(15)]
    assert checklog.check(lines) == []


@pytest.mark.usefixtures("small")
def test_a_steps_journal_keeps_the_lines_of_the_minds_the_object_keeps_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=2))
    for i in range(20):
        w.mind(mind(i))
    w.loop.pass_once()
    body = w.api.objects[ENGINE]
    body["status"]["conditions"] = [{"type": "Ready", "status": "False", "reason": "Relaunching"}]
    body["metadata"]["resourceVersion"] = "999"
    w.engines.observe_engine(body, deleted=False, nudge=False)
    w.loop.pass_once()  # not ready: eighteen queued minds told why they wait
    step = w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]
    kept = {e["mind"] for e in w.api.objects[LEDGER]["status"]["grants"]}
    journaled = [x for x in step["lines"] if x["event"] == "transition"]
    in_log = [x for x in log_lines(tmp_path) if x.get("seq") == step["seq"]]
    assert step["omitted"] == len(in_log) - len(step["lines"]) > 0
    assert {x["mind"] for x in journaled} <= kept
    assert len(journaled) == sum(1 for x in in_log if x.get("mind") in kept)
    assert checklog.check(log_lines(tmp_path)) == []


def test_a_mind_the_table_does_not_list_is_queued_behind_its_head_when_it_lists_only_the_head() -> (
    None
):
    body = engine("team-a", "coder", slots=1)
    body["status"]["grants"] = [{"mind": "team-a/a", "state": "Granted", "reason": "SlotFree",
                                 "slot": 0, "tokens": 1000}]  # fmt: skip
    body["status"][grant_ledger.CAPACITY_FIELD] = {
        "phase": "Serving",
        "slots": 1,
        "tokensPerSlot": 1000,
    }
    answer = admit_turn(table_from_ledger(body), "team-a/z")
    assert (answer.status, answer.refusal) == (403, Refusal.FORBIDDEN)
    body["status"][grant_ledger.QUEUE_FIELD] = {"queued": 300, "refused": 0, "keptQueued": 256,
                                          "keptRefused": 0}  # fmt: skip
    answer = admit_turn(table_from_ledger(body), "team-a/z")
    assert (answer.status, answer.refusal) == (429, Refusal.QUEUED)
    assert answer.body["reason"] == BEYOND_TABLE and "status.grant" in answer.body["message"]


def test_a_holder_released_in_a_step_the_log_missed_is_released_in_the_log_too(
    tmp_path: Path,
) -> None:
    """Found by the random-kill e2e in CI: a deleted holder's grace ran out in a step whose
    leader died before its log append. She leaves the Engine object in that step, so a journal
    that keeps only the object's minds lost her release, and the log showed her slot granted
    twice. The lines of a mind who held a slot in the step are journaled, kept or not."""
    w = World(tmp_path)
    now = [1_000.0]
    w.loop.clock = lambda: now[0]
    w.engine(engine("team-a", "coder", slots=1))
    for i in range(2):
        w.mind(mind(i))
    w.loop.pass_once()
    gone = json.loads(json.dumps(w.api.objects[f"{BASE}/team-a/minds/mind-00000"]))
    gone["metadata"].update(deletionTimestamp="2026-12-03T07:00:00Z", resourceVersion="5")
    w.api.add(gone, "minds")
    w.cache.observe_mind(gone, deleted=False)
    w.loop.pass_once()
    assert w.ledger("team-a", "coder")["team-a/mind-00000"][0] == "Reclaiming"
    # The grace runs out; this leader writes the ledger and dies before its log append.
    w.loop.log.append = lambda engine, seq, lines: None  # type: ignore[method-assign]
    now[0] += w.loop.settings.grace_seconds + 1
    w.loop.pass_once()
    assert w.ledger("team-a", "coder")["team-a/mind-00001"][0] == "Granted"
    assert "team-a/mind-00000" not in w.ledger("team-a", "coder")
    new_leader(w, tmp_path)
    w.loop.pass_once()
    moves = [(x["mind"][-2:], x["to"]) for x in log_lines(tmp_path) if x["event"] == "transition"]
    assert moves[-2:] == [("00", "Released"), ("01", "Granted")]
    assert checklog.check(log_lines(tmp_path)) == []


def test_a_step_the_log_missed_is_logged_when_a_new_leader_writes_over_it_from_a_stale_cache(
    tmp_path: Path,
) -> None:
    """Found by the random-kill e2e in CI (a gap in the log's step seqs): a leader wrote a
    step and died before its log append; the next leader's cache had not yet seen that write,
    so its journal recovery found nothing missing, its own write was refused (409), and it
    decided again from the Engine read back and wrote over the unlogged journal. Whatever
    journal a write replaces is logged first."""
    w = World(tmp_path)
    w.engine(engine("team-a", "coder", slots=1))
    w.mind(mind(0))
    w.loop.pass_once()
    stale = json.loads(json.dumps(w.engines.engines[("team-a", "coder")]))
    # One more mind; this leader writes her step (she queues) and dies before its log append.
    w.mind(mind(1))
    w.loop.log.append = lambda engine, seq, lines: None  # type: ignore[method-assign]
    w.loop.pass_once()
    lost = w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]["seq"]
    new_leader(w, tmp_path)
    # The new leader's cache still holds the Engine from before that write (its watch event
    # not yet seen).
    w.engines.engines[("team-a", "coder")] = stale
    w.mind(mind(2))
    w.loop.pass_once()
    seqs = [x["seq"] for x in log_lines(tmp_path)]
    assert lost in seqs
    blocks = [q for i, q in enumerate(seqs) if i == 0 or seqs[i - 1] != q]
    assert blocks == list(
        range(1, w.api.objects[LEDGER]["status"][grant_ledger.STEP_FIELD]["seq"] + 1)
    )
    assert checklog.check(log_lines(tmp_path)) == []
