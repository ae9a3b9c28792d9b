"""The operator's transition log: every change to a grant ledger, as JSON lines.

The format is docs/transition-log.md's, the simulator's, so `continuum check-log` judges the
operator from outside. Each step's lines go out in one `write` on a file opened for appending,
under one lock, so steps written side by side never interleave, replicas taking turns as
leader append to one file, and a crash leaves whole steps only.

Group commit: the lines are written at once but flushed to disk (`sync`) once per grants pass
and before a leader steps down, not once per step (one fsync per step, under the lock, kept
the ledger writers queued behind each other). A killed process loses nothing written: the
lines are in the page cache. A machine that crashes may lose the last pass's lines; the steps
are journaled with their ledger (below), so the next leader's first pass, which recovers every
engine, appends them again.

Two rules keep the log checkable across crashes and leaders:
- `t` never goes backwards: a step is logged at no earlier than the file's last line.
- A step is the ledger write's, not the log's: the lines are also kept in the GrantLedger's
  status (`status.grantStep`, written with the ledger). `recover` appends a journaled step the log
  lacks, found by its `seq` (a leader died between the ledger write and the append).

The log also knows, for each engine, the minds whose last line left them waiting: queued, or
refused (`places`). An Engine object keeps only the head of a long queue (docs/grants.md,
"Bounded"); a new leader takes the rest from here, so that what it decides next follows from
what the log says, line for line, whatever a crash left unwritten.
Neighbours: `kube.grants.loop` (the writer), `checklog` (the reader).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from continuum_operator.kube.client.body import number

__all__ = ["Place", "TransitionLog"]

#: Refusals (`Released` that a mind keeps while she asks too much): she stays listed.
_REFUSALS = frozenset({"ContextTooLarge", "ClassLimit", "ClassNotAllowed"})


class Place(NamedTuple):
    """A waiting mind's last line: state (`Queued`, or `Released` for a refusal), reason, `t`
    (when that state began), priority and protection window."""

    state: str
    reason: str
    t: float
    priority: float
    window: float


class TransitionLog:
    """Appends steps to a JSON-lines file; None path: nothing is written, `t` still ordered."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        # Steps are appended from the grants loop's event loop, and synced from a thread (once a
        # pass, in `asyncio.to_thread`, its fsync off the loop) while the next pass appends.
        self.lock = threading.Lock()
        self.last_t = 0.0
        self.seqs: dict[str, int] = {}  # engine -> last step seq in the file
        self.ledgers: dict[str, str] = {}  # engine -> the GrantLedger its last lines name
        self.places: dict[str, dict[str, Place]] = {}  # engine -> waiting mind -> her last line
        self.unsynced = False  # lines written since the last `sync`
        if path is not None and path.exists():
            self._scan(path)

    def _scan(self, path: Path) -> None:
        with path.open() as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(line, dict):
                    continue
                t = line.get("t")
                if isinstance(t, int | float):
                    self.last_t = max(self.last_t, float(t))
                seq, engine = line.get("seq"), line.get("engine")
                if isinstance(engine, str):
                    self._begin(engine, line.get("ledger"))
                if isinstance(seq, int) and isinstance(engine, str):
                    self.seqs[engine] = max(self.seqs.get(engine, 0), seq)
                self._place(line)

    def _begin(self, engine: str, ledger: object) -> None:
        """A line naming another GrantLedger than the engine's last lines did: an Engine made
        again under its name, whose ledger counts its steps from 1 and holds nothing of the
        old one's. What the log knew of the engine is forgotten."""
        if not isinstance(ledger, str):
            return
        if self.ledgers.get(engine, ledger) != ledger:
            self.seqs.pop(engine, None)
            self.places.pop(engine, None)
        self.ledgers[engine] = ledger

    def _place(self, line: Mapping[str, object]) -> None:
        """Keep a transition's mind in `places` while it leaves her waiting."""
        engine, mind = line.get("engine"), line.get("mind")
        if line.get("event") != "transition" or not isinstance(engine, str):
            return
        if not isinstance(mind, str):
            return
        to, reason = line.get("to"), str(line.get("reason"))
        waiting = to == "Queued" or (to == "Released" and reason in _REFUSALS)
        places = self.places.setdefault(engine, {})
        if not waiting:
            places.pop(mind, None)
            return
        t, priority, window = line.get("t"), line.get("priority"), line.get("protectionWindow")
        numbers = [x if isinstance(x, int | float) else 0.0 for x in (t, priority, window)]
        places[mind] = Place(str(to), reason, *map(float, numbers))

    def waiting(self, engine: str) -> dict[str, Place] | None:
        """The minds the log leaves waiting on an engine; None when no log is kept."""
        if self.path is None:
            return None
        return dict(self.places.get(engine, {}))

    def time(self, now: float) -> float:
        """The time a step decided now is logged at: never before the last line."""
        return max(now, self.last_t)

    def logged(self, engine: str, seq: int, ledger: str | None = None) -> bool:
        """Whether the step `seq` of the engine's GrantLedger `ledger` is in the log (a step of
        another ledger than the log's last for the engine is not)."""
        if ledger is not None and self.ledgers.get(engine, ledger) != ledger:
            return False
        return self.seqs.get(engine, 0) >= seq

    def append(self, engine: str, seq: int, lines: Sequence[Mapping[str, object]]) -> None:
        if not lines:
            return
        with self.lock:
            self._append(engine, seq, lines)

    def _append(self, engine: str, seq: int, lines: Sequence[Mapping[str, object]]) -> None:
        t = max(self.last_t, *(number(line.get("t")) for line in lines))
        written = [
            {**line, "t": max(number(line.get("t")), self.last_t), "seq": seq} for line in lines
        ]
        text = "".join(json.dumps(line) + "\n" for line in written)
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            self.unsynced = True
        self.last_t = t
        self._begin(engine, lines[0].get("ledger"))
        self.seqs[engine] = max(self.seqs.get(engine, 0), seq)
        if self.path is not None:
            for line in written:
                self._place(line)

    def sync(self) -> None:
        """Flush the lines written so far to disk (once a pass: group commit)."""
        with self.lock:
            if self.path is None or not self.unsynced:
                return
            self.unsynced = False
        # Outside the lock: steps go on being written meanwhile, and are synced the next time.
        # (fsync flushes the file's pages, whichever descriptor wrote them.)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def recover(self, engine: str, journal: Mapping[str, object] | None) -> bool:
        """Append the journaled step of an Engine if the log lacks it; True if it did."""
        if self.nothing_to_recover(engine, journal):
            return False
        assert journal is not None
        seq, lines = journal.get("seq"), journal.get("lines")
        assert isinstance(seq, int) and isinstance(lines, list)  # (as nothing_to_recover read)
        self.append(engine, seq, lines)
        return True

    def nothing_to_recover(self, engine: str, journal: object) -> bool:
        """Whether `recover` would append nothing for this journal: none, one without a step
        (seq and lines), or a step the log has. Read from the journal as stored (its times as
        text), so a pass asks before it reads every line's times (`journal.read_journal`),
        which it did for every engine each full pass while the log had every step."""
        if not journal or not isinstance(journal, Mapping):
            return True
        seq, lines = journal.get("seq"), journal.get("lines")
        if not isinstance(seq, int) or not isinstance(lines, list) or not lines:
            return True
        ledger = lines[0].get("ledger") if isinstance(lines[0], Mapping) else None
        return self.logged(engine, seq, ledger if isinstance(ledger, str) else None)
