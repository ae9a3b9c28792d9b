"""Tenancy in the grants loop (`kube.grants.loop`, `kube.ledger.grant_ledger`; docs/tenancy.md):
Minds routed to an Engine of another namespace, refused where it does not serve hers or her class
does not exist, and a namespace's TokenQuota held over several engines, its status written only when
changed."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum_operator.core.grants import MindDemand
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.grants.quota_use import QuotaUse, quota_status
from continuum_operator.kube.ledger import grant_ledger, routing
from continuum_operator.kube.state.cache import Cache
from tests.support.builders import stored_ledger
from tests.support.grants_world import BASE, World, engine, mind, quota


def test_a_mind_names_an_engine_of_another_namespace_that_serves_hers(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("shared", "coder", allowed=["team-b"]))
    w.mind(mind("team-b", "ann", "coder", engineNamespace="shared"))
    w.loop.pass_once()
    assert w.ledger("shared", "coder") == {"team-b/ann": ("Granted", "SlotFree")}
    status = w.status("minds", "team-b", "ann")
    assert status["grant"]["state"] == "Granted"
    assert status["endpoint"] == "http://coder.shared.svc:8080"


def test_a_mind_of_a_namespace_the_engine_does_not_serve_gets_no_grant_and_is_told_why(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("shared", "coder", allowed=["team-b"]))
    w.mind(mind("team-c", "cid", "coder", engineNamespace="shared"))
    w.loop.pass_once()
    assert w.ledger("shared", "coder") == {}
    cond = w.granted("team-c", "cid")
    assert (cond["status"], cond["reason"]) == ("False", "EngineNotAllowed")
    assert "Engine shared/coder does not serve namespace team-c" in cond["message"]
    assert "spec.allowedNamespaces" in cond["message"]
    grant = w.status("minds", "team-c", "cid")["grant"]  # `kubectl get minds` says it too
    assert (grant["state"], grant["reason"], grant["tokens"]) == ("Refused", "EngineNotAllowed", 0)


def test_a_mind_naming_an_engine_that_does_not_exist_is_told_so_once(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.mind(mind("team-b", "ann", "codr"))
    w.loop.pass_once()
    cond = w.granted("team-b", "ann")
    assert (cond["status"], cond["reason"]) == ("False", "EngineNotFound")
    assert "Engine team-b/codr does not exist" in cond["message"]
    assert "spec.engine" in cond["message"]
    assert w.api.gets == [f"{BASE}/team-b/engines/codr"]
    # Her status says it now: later passes neither ask the API again nor write.
    patches = len(w.api.patches)
    w.loop.pass_once()
    assert w.api.gets == [f"{BASE}/team-b/engines/codr"] and len(w.api.patches) == patches


def test_a_mind_of_an_engine_another_operator_serves_is_left_alone(tmp_path: Path) -> None:
    w = World(tmp_path)
    # In the API, not in this operator's cache (its engine selector does not match it).
    w.api.add(engine("team-b", "other"), "engines")
    w.mind(mind("team-b", "ann", "other"))
    w.loop.pass_once()
    assert w.status("minds", "team-b", "ann") == {}


def test_an_engine_serves_its_own_namespace_and_every_one_with_a_star() -> None:
    body = engine("shared", "coder", allowed=["*"])
    assert routing.engine_serves(body, "anyone") and routing.engine_serves(body, "shared")
    plain = engine("shared", "coder")
    assert routing.engine_serves(plain, "shared") and not routing.engine_serves(plain, "other")


def test_a_mind_whose_engine_stops_serving_her_namespace_is_reclaimed(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("shared", "coder", allowed=["team-b"]))
    w.mind(mind("team-b", "ann", "coder", engineNamespace="shared"))
    w.loop.pass_once()
    w.engine(
        {**w.api.objects[f"{BASE}/shared/engines/coder"], "spec": {"contextTokensPerMind": 1000}}
    )
    w.loop.pass_once()
    assert w.ledger("shared", "coder")["team-b/ann"][0] == "Reclaiming"
    assert w.granted("team-b", "ann")["reason"] == "EngineNotAllowed"


def test_a_mind_naming_a_class_that_does_not_exist_gets_a_condition_and_no_grant(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder", className="gold"))
    w.loop.pass_once()
    assert w.ledger("team-a", "coder") == {}
    cond = w.granted("team-a", "ann")
    assert (cond["status"], cond["reason"]) == ("False", "ClassNotFound")
    assert "MindClass gold does not exist" in cond["message"]


def test_a_mind_over_her_class_limit_is_refused_with_the_class_and_limit_named(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.cls("small", maxTokens=128)
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder", className="small"))
    w.loop.pass_once()
    assert w.ledger("team-a", "coder") == {"team-a/ann": ("Released", "ClassLimit")}
    status = w.status("minds", "team-a", "ann")
    assert "asks 256 tokens but MindClass small allows at most 128" in status["grant"]["message"]
    too_large = next(c for c in status["conditions"] if c["type"] == "ContextTooLarge")
    assert (too_large["status"], too_large["reason"]) == ("True", "ClassLimit")


def test_the_default_class_limit_applies_to_minds_that_name_none(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.cls("std", maxTokens=600, default=True)
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder"))
    w.loop.pass_once()
    entry = stored_ledger(w.api.objects, "team-a", "coder")["grants"][0]
    assert (entry["state"], entry["tokens"]) == ("Granted", 600)


def test_a_namespace_quota_holds_over_two_engines_and_its_status_says_so(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "one", slots=1))
    w.engine(engine("team-a", "two", slots=1))
    w.quota(quota("team-a", "tokens", 1000))
    w.mind(mind("team-a", "ann", "one", second=1))
    w.mind(mind("team-a", "bob", "two", second=2))
    w.loop.pass_once()
    ledgers = {**w.ledger("team-a", "one"), **w.ledger("team-a", "two")}
    # One grant of 1000 tokens fills the quota: the other engine grants nothing, though free.
    assert sorted(ledgers.values()) == [("Granted", "SlotFree"), ("Queued", "QuotaExceeded")]
    [held_back] = [m for m, (s, _) in ledgers.items() if s == "Queued"]
    status = w.status("tokenquotas", "team-a", "tokens")
    assert (status["usedTokens"], status["mindsHeld"], status["mindsQueued"]) == (1000, 1, 1)
    assert status["queued"] == [held_back.split("/")[1]]
    limiting = status["conditions"][0]
    assert (limiting["type"], limiting["status"], limiting["reason"]) == (
        "Limiting", "True", "MindsQueued"
    )  # fmt: skip
    message = w.status("minds", "team-a", held_back.split("/")[1])["grant"]["message"]
    assert "TokenQuota team-a/tokens allows namespace team-a 1000 tokens" in message
    assert "its minds hold 1000" in message


def test_the_tightest_of_several_quotas_in_a_namespace_applies(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.cls("small", maxTokens=400)
    w.engine(engine("team-a", "coder", slots=3))
    w.quota(quota("team-a", "loose", 5000))
    w.quota(quota("team-a", "tight", 800))
    for i in range(3):
        w.mind(mind("team-a", f"m{i}", "coder", second=i, className="small"))
    w.loop.pass_once()
    assert sorted(w.ledger("team-a", "coder").values()) == [
        ("Granted", "SlotFree"), ("Granted", "SlotFree"), ("Queued", "QuotaExceeded")
    ]  # fmt: skip
    assert w.status("tokenquotas", "team-a", "tight")["conditions"][0]["status"] == "True"
    loose = w.status("tokenquotas", "team-a", "loose")["conditions"][0]
    assert (loose["status"], loose["reason"]) == ("False", "Looser")


def test_a_quota_status_is_written_only_when_it_changed(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "coder"))
    w.quota(quota("team-a", "tokens", 5000))
    w.mind(mind("team-a", "ann", "coder"))
    w.loop.pass_once()
    quota_writes = [p for p, _ in w.api.patches if "/tokenquotas/" in p]
    assert len(quota_writes) == 1
    w.loop.pass_once()
    assert [p for p, _ in w.api.patches if "/tokenquotas/" in p] == quota_writes


def test_quota_limits_and_tokens_held_read_from_the_objects() -> None:
    limits = routing.quota_limits([quota("a", "x", 900), quota("a", "y", 300), quota("b", "z", 7)])
    assert {ns: (q.max_tokens, q.quota) for ns, q in limits.items()} == {
        "a": (300, "a/y"), "b": (7, "b/z")
    }  # fmt: skip
    entries = [
        {"mind": "a/m", "state": "Granted", "tokens": 100},
        {"mind": "a/n", "state": "Reclaiming", "tokens": 50},
        {"mind": "a/o", "state": "Queued", "tokens": 0},
        {"mind": "b/p", "state": "Granted", "tokens": 9},
    ]
    assert routing.tokens_held(grant_ledger.read_entries(entries)) == {"a": 150, "b": 9}


def test_demands_carry_the_class_token_limit() -> None:
    classes, default = routing.classes_of(
        [{"metadata": {"name": "s"}, "spec": {"priority": 3, "maxTokens": 64, "default": True}}]
    )
    [d] = routing.demands_of([mind("n", "a", "e")], classes, default).values()
    assert d == MindDemand("n/a", 3, d.arrival, 256, 300.0, 64)


@st.composite
def tenants(draw: st.DrawFn) -> tuple[list[tuple[str, str, int, int]], dict[str, int]]:
    """Minds (namespace, engine, arrival, class limit) over three engines, and quotas."""
    minds = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["t", "u"]),
                st.sampled_from(["one", "two", "three"]),
                st.integers(0, 59),
                st.sampled_from([300, 600, 1000]),
            ),
            max_size=12,
        )
    )
    quotas = draw(st.dictionaries(st.sampled_from(["t", "u"]), st.integers(0, 3000)))
    return minds, quotas


@settings(max_examples=40, deadline=None)
@given(tenants())
def test_passes_over_several_engines_never_take_a_namespace_past_its_quota(
    case: tuple[list[tuple[str, str, int, int]], dict[str, int]],
) -> None:
    minds, quotas = case
    with tempfile.TemporaryDirectory() as tmp:
        w = World(Path(tmp))
        for limit in (300, 600, 1000):
            w.cls(f"c{limit}", maxTokens=limit)
        for name in ("one", "two", "three"):
            w.engine(engine("shared", name, slots=2, allowed=["*"]))
        for ns, limit in quotas.items():
            w.quota(quota(ns, "q", limit))
        for i, (ns, eng, second, limit) in enumerate(minds):
            w.mind(mind(ns, f"m{i}", eng, second, engineNamespace="shared", className=f"c{limit}"))
        for _ in range(2):
            w.loop.pass_once()
        held: dict[str, int] = {}
        for name in ("one", "two", "three"):
            status = stored_ledger(w.api.objects, "shared", name)
            for ns, tokens in routing.tokens_held(
                grant_ledger.read_entries(status.get("grants"))
            ).items():
                held[ns] = held.get(ns, 0) + tokens
        for ns, limit in quotas.items():
            assert held.get(ns, 0) <= limit, (ns, held, quotas)
            reported = w.status("tokenquotas", ns, "q")["usedTokens"]
            assert reported == held.get(ns, 0)


def test_a_quota_condition_without_a_transition_time_gets_one() -> None:
    quota = {
        "metadata": {"namespace": "team", "name": "q", "generation": 1},
        "spec": {"maxTokens": 1000},
        "status": {
            "conditions": [{"type": "Limiting", "status": "False", "reason": "WithinQuota"}]
        },
    }
    use = QuotaUse(routing.quota_limits([quota]), {})
    new = quota_status(quota, use, 1_800_000_000.0)
    assert new is not None and isinstance(new["conditions"], list)
    assert new["conditions"][0]["lastTransitionTime"] == format_seconds(1_800_000_000.0)


def another_operators_engine(w: World, ns: str, entry: dict[str, Any]) -> None:
    """Engine `theirs` of `ns`, in the API server but not in this operator's cache (another
    operator's selector), its GrantLedger watched here with one entry."""
    w.api.add(engine(ns, "theirs"), "engines")
    ledger = {
        "metadata": {"namespace": ns, "name": "theirs", "resourceVersion": "7"},
        "status": {"grants": [entry]},
    }
    w.engines.observe_ledger(ledger, deleted=False, nudge=False)


def _deleting(body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["finalizers"] = ["continuum.dev/grant"]
    body["metadata"]["deletionTimestamp"] = "2026-12-06T10:00:00Z"
    return body


def test_a_deleting_mind_of_an_engine_another_operator_serves_keeps_her_finalizer(
    tmp_path: Path,
) -> None:
    # Her Engine exists but is not in this operator's cache (`--engine-selector`): its own
    # operator reclaims her slot through the gateway before it takes the finalizer off. Taken
    # off here, she would be gone with her turn still running.
    w = World(tmp_path)
    another_operators_engine(w, "team-b", {"mind": "team-b/bo", "state": "Reclaiming", "slot": 0})
    w.mind(_deleting(mind("team-b", "bo", "theirs")))
    w.loop.pass_once()
    stored = w.api.objects[f"{BASE}/team-b/minds/bo"]
    assert stored["metadata"]["finalizers"] == ["continuum.dev/grant"]
    assert "grant" not in (stored.get("status") or {})  # nor told her Engine is missing


def test_a_deleting_mind_no_ledger_holds_loses_her_finalizer_whoever_serves_her_engine(
    tmp_path: Path,
) -> None:
    # Her finalizer guards a slot; no GrantLedger holds one for her (an Engine no operator
    # serves, say: the chart's admission policy put the finalizer on her at creation).
    w = World(tmp_path)
    w.api.add(engine("team-b", "unserved"), "engines")
    w.mind(_deleting(mind("team-b", "bo", "unserved")))
    w.loop.pass_once()
    assert not w.api.objects[f"{BASE}/team-b/minds/bo"]["metadata"].get("finalizers")
    assert "grant" not in (w.api.objects[f"{BASE}/team-b/minds/bo"].get("status") or {})


def test_a_deleting_mind_of_an_engine_that_does_not_exist_loses_her_finalizer(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.mind(_deleting(mind("team-b", "bo", "gone")))
    w.loop.pass_once()
    assert not w.api.objects[f"{BASE}/team-b/minds/bo"]["metadata"].get("finalizers")


def test_a_quota_counts_what_another_operators_engines_hold(tmp_path: Path) -> None:
    # A namespace's TokenQuota spans every Engine, whichever operator serves it
    # (`--engine-selector`): the other's GrantLedgers, watched here too, count toward it.
    w = World(tmp_path)
    w.engine(engine("team-a", "ours", slots=2))
    held = {"mind": "team-a/old", "state": "Granted", "slot": 0, "tokens": 1000}
    another_operators_engine(w, "team-a", held)
    w.quota(quota("team-a", "tokens", 1500))
    w.mind(mind("team-a", "ann", "ours", second=1))
    w.loop.pass_once()
    assert w.ledger("team-a", "ours") == {"team-a/ann": ("Queued", "QuotaExceeded")}
    status = w.status("tokenquotas", "team-a", "tokens")
    assert status["usedTokens"] == 1000 and status["mindsHeld"] == 1


def test_minds_of_an_engine_whose_ledger_is_watched_cost_no_get(tmp_path: Path) -> None:
    # Another operator's Engine, its GrantLedger watched here: the Engine lives (its ledger
    # goes with it), so its Minds are neither asked about nor told anything from here.
    w = World(tmp_path)
    another_operators_engine(w, "team-b", {"mind": "team-b/bo", "state": "Granted", "slot": 0})
    w.mind(mind("team-b", "bo", "theirs"))
    w.loop.pass_once()
    w.loop.queue.mark_all()
    w.loop.pass_once()
    assert [c for c in w.api.calls if "/engines/" in c.path or "/minds/" in c.path] == []


def test_minds_of_a_deleted_engine_are_told_once_its_ledger_is_gone_too(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder"))
    w.loop.pass_once()
    assert w.status("minds", "team-a", "ann")["grant"]["state"] == "Granted"
    body = w.api.objects.pop(f"{BASE}/team-a/engines/coder")
    w.engines.observe_engine(body, deleted=True)
    w.loop.pass_once()  # its ledger not deleted yet by the garbage collector
    ledger = w.engines.ledgers[("team-a", "coder")]
    w.engines.observe_ledger(ledger, deleted=True)
    w.loop.pass_once()
    assert w.status("minds", "team-a", "ann")["grant"]["reason"] == "EngineNotFound"


def test_a_mind_moved_off_an_engine_and_deleted_keeps_her_finalizer_until_its_slot_is_released(
    tmp_path: Path,
) -> None:
    # Found by review: `spec.engine` may change while she holds a slot. Her old Engine
    # reclaims it; her finalizer was decided from her new Engine's ledger alone, and came off
    # with the old slot still Reclaiming (her turn still running there).
    w = World(tmp_path)
    now = [1_000.0]
    w.loop.clock = lambda: now[0]
    w.engine(engine("team-a", "one", slots=1))
    w.mind(mind("team-a", "ada", "one"))
    w.loop.pass_once()
    path = f"{BASE}/team-a/minds/ada"
    moved = copy.deepcopy(w.api.objects[path])
    assert moved["metadata"]["finalizers"] == ["continuum.dev/grant"]
    moved["spec"]["engine"] = "two"  # an Engine that does not exist
    moved["metadata"].update(generation=2, deletionTimestamp="2026-12-05T10:00:00Z")
    moved["metadata"]["resourceVersion"] = str(int(moved["metadata"]["resourceVersion"]) + 1)
    w.api.objects[path] = moved
    w.cache.observe_mind(moved, deleted=False, nudge=False)
    w.loop.pass_once()
    w.loop.pass_once()
    assert w.ledger("team-a", "one")["team-a/ada"][0] == "Reclaiming"
    assert w.api.objects[path]["metadata"]["finalizers"] == ["continuum.dev/grant"]
    now[0] += 600  # past the grace: the slot is released, then her finalizer comes off
    w.loop.pass_once()
    w.loop.pass_once()
    assert "team-a/ada" not in w.ledger("team-a", "one")
    assert not w.api.objects[path]["metadata"].get("finalizers")


def test_the_cache_knows_which_ledgers_hold_a_mind_as_they_change() -> None:
    # `MindWrites.held_anywhere` asks it for each deleted Mind at each pass: one lookup, kept
    # with the ledgers, not a read of every ledger.
    cache = Cache()
    meta = {"namespace": "team-b", "name": "theirs", "uid": "l1"}

    def ledger(rv: str, *entries: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {**meta, "resourceVersion": rv}, "status": {"grants": list(entries)}}

    holding = {"mind": "team-b/bo", "state": "Reclaiming", "slot": 0}
    cache.observe_ledger(ledger("1", holding), deleted=False, nudge=False)
    assert cache.holders.holds("team-b/bo") and not cache.holders.holds("team-b/al")
    cache.observe_ledger(ledger("2", {**holding, "state": "Queued"}), deleted=False, nudge=False)
    assert not cache.holders.holds("team-b/bo")  # queued: holds no slot
    cache.observe_ledger(ledger("3", holding), deleted=False, nudge=False)
    cache.observe_ledger(ledger("4"), deleted=True, nudge=False)
    assert not cache.holders.holds("team-b/bo")  # the ledger is gone
