"""What a grants pass reads once and keeps (`kube.grants.loop`: the entries of each ledger read
once a step from the pass's `LedgerFacts`, every engine's entries kept for the pass only where a
TokenQuota reads them): the ledger as the API server holds it is still validated entry by entry,
and a TokenQuota still counts its namespace's minds whatever its limit says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.grants_world import World, engine, mind, quota


def _ledger(ns: str, name: str, *entries: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "GrantLedger",
        "metadata": {"namespace": ns, "name": name, "resourceVersion": "3"},
        "status": {"grants": list(entries)},
    }


def test_a_malformed_entry_in_a_stored_ledger_is_skipped_and_the_rest_decided(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("ns", "e", slots=2))
    held = {"mind": "ns/ann", "state": "Granted", "reason": "SlotFree", "sinceUnix": 900.0,
            "tokens": 1000, "slot": 0, "priority": 0, "protectionWindow": 300.0}  # fmt: skip
    # Slot 1 as a word: not a GrantEntry. Were it taken as read, she would hold slot 1.
    bad = {"mind": "ns/bob", "state": "Granted", "reason": "SlotFree", "tokens": 1000,
           "slot": "one"}  # fmt: skip
    stored = _ledger("ns", "e", held, bad)
    w.api.add(stored, "grantledgers")
    w.engines.observe_ledger(stored, deleted=False, nudge=False)
    w.mind(mind("ns", "ann", "e", second=1))
    w.mind(mind("ns", "cy", "e", second=2))
    w.loop.pass_once()
    assert w.ledger("ns", "e") == {
        "ns/ann": ("Granted", "SlotFree"),  # kept: her entry read
        "ns/cy": ("Granted", "SlotFree"),  # slot 1, which the unread entry did not hold
    }
    assert w.status("minds", "ns", "cy")["grant"]["slot"] == 1


def test_a_quota_whose_limit_cannot_be_read_still_counts_its_namespaces_minds(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("ns", "e", slots=2))
    unread = quota("ns", "tokens", 0)
    unread["spec"]["maxTokens"] = "lots"  # no limit read from it: nothing is held back
    w.quota(unread)
    w.mind(mind("ns", "ann", "e", second=1))
    w.loop.pass_once()  # ann granted
    w.loop.queue.resynced_at = None
    w.loop.pass_once()  # the quota's status from the ledger as written
    assert w.ledger("ns", "e") == {"ns/ann": ("Granted", "SlotFree")}
    status = w.status("tokenquotas", "ns", "tokens")
    assert (status["mindsHeld"], status["mindsQueued"]) == (1, 0)
