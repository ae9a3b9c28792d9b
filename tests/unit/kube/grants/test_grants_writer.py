"""The leader's ledger writes (`kube.grants.loop.GrantsLoop`, `kube.grants.ledger_write`) against a
stand-in API server: the Engine's GrantLedger made at its first step, owned by it; each step a
replace of the ledger's status carrying its resourceVersion, never a blind merge; on 409 the ledger
is read again and the step decided again on what it now says; a ledger an earlier Engine of the name
left is replaced, never read as this one's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.engine.admission import table_from_ledger
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.grants.ledger_write import seed_ledgers
from continuum_operator.kube.grants.loop import GrantsLoop
from continuum_operator.kube.process.run import join_caches
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.mind_cache import MindCache
from tests.support.builders import ledger_path
from tests.support.fakes import FakeKubeApi

NS = "minds"
BASE = f"/apis/continuum.dev/v1alpha1/namespaces/{NS}"
ENGINE_PATH = f"{BASE}/engines/coder"
LEDGER_PATH = ledger_path(NS, "coder")


def engine_body() -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"namespace": NS, "name": "coder", "resourceVersion": "10", "uid": "u-1"},
        "spec": {"contextTokensPerMind": 512},
        "status": {
            "plan": {"node": "n", "engineArgs": ["-np", "1"], "mindsGrantable": 1,
                     "contextTokensPerMind": 512},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }  # fmt: skip


def mind(name: str, cls: str, second: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": name, "resourceVersion": "1",
                     "creationTimestamp": f"2026-12-03T06:00:{second:02d}Z"},
        "spec": {"engine": "coder", "className": cls, "contextTokens": 256},
    }  # fmt: skip


class Clock:
    now = 1_000.0

    def __call__(self) -> float:
        return self.now


def setup(
    tmp_path: Path, *minds: dict[str, Any], api: FakeKubeApi | None = None
) -> tuple[FakeKubeApi, GrantsLoop, Clock]:
    """One Engine with a resourceVersion, and no Mind at the API server: their projections
    are not under test here (each write of one is a 404)."""
    api = api or FakeKubeApi()
    api.add(engine_body(), "engines")
    engines, cache = Cache(), MindCache()
    join_caches(engines, cache)
    engines.observe_engine(api.objects[ENGINE_PATH], deleted=False, nudge=False)
    for m in minds:
        cache.observe_mind(m, deleted=False, nudge=False)
    for name, priority in (("low", 0), ("high", 10)):
        spec = {"priority": priority, "protectionWindowSeconds": 0}
        cache.classes[name] = {"metadata": {"name": name}, "spec": spec}
    clock = Clock()
    settings = GrantSettings(transition_log=tmp_path / "log.jsonl", write_workers=1)
    loop = GrantsLoop(api.aio, settings, engines, cache, clock=clock)  # type: ignore[arg-type]
    return api, loop, clock


def the_ledger(api: FakeKubeApi) -> dict[str, Any]:
    return api.objects[LEDGER_PATH]


def states(api: FakeKubeApi) -> dict[str, tuple[str, str]]:
    return {e["mind"]: (e["state"], e["reason"]) for e in the_ledger(api)["status"]["grants"]}


def test_the_first_step_makes_the_ledger_owned_by_the_engine_then_replaces_its_status(
    tmp_path: Path,
) -> None:
    api, loop, _ = setup(tmp_path, mind("a", "low", 1))
    loop.pass_once()
    [made] = api.created
    assert made["metadata"]["ownerReferences"] == [
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine", "name": "coder",
         "uid": "u-1", "controller": True}
    ]  # fmt: skip
    [put] = api.puts
    written = [(m, p) for m, p in api.requests if m in ("PUT", "PATCH") and "/minds/a" not in p]
    assert written == [("PUT", f"{LEDGER_PATH}/status")]  # a grant no longer rewrites the Engine
    assert int(put["metadata"]["resourceVersion"]) == 1  # the version the create answered
    assert set(put["status"]) == {"grants", "grantCapacity", "grantStep"}  # the ledger alone
    assert states(api) == {f"{NS}/a": ("Granted", "SlotFree")}
    assert the_ledger(api)["status"]["grantStep"]["seq"] == 1
    assert "grants" not in api.objects[ENGINE_PATH]["status"]
    # The next step replaces the ledger made: no second create.
    loop.minds.observe_mind(mind("b", "low", 2), deleted=False, nudge=False)
    loop.pass_once()
    assert len(api.created) == 1 and len(api.puts) == 2
    assert states(api)[f"{NS}/b"] == ("Queued", "PoolFull")


def test_a_conflict_is_read_again_and_decided_again_on_what_the_ledger_now_says(
    tmp_path: Path,
) -> None:
    api, loop, clock = setup(tmp_path, mind("a", "low", 1))
    loop.pass_once()
    loop.minds.observe_mind(mind("vip", "high", 2), deleted=False, nudge=False)
    clock.now += 1
    loop.pass_once()  # a is preempted: Reclaiming
    assert states(api)[f"{NS}/a"] == ("Reclaiming", "Preempted")

    def deposed_leader_writes(ledger: dict[str, Any]) -> None:
        # A leader that lost its Lease and had not noticed: its late write gave vip the slot.
        status = ledger["status"]
        status["grants"] = [
            {**e, "state": "Granted", "reason": "SlotFree", "slot": 0}
            for e in status["grants"]
            if e["mind"] == f"{NS}/vip"
        ]  # (the double bumps its resourceVersion, as that write would)

    # This leader's cache has not seen that write when its next pass decides.
    loop.minds.observe_mind(mind("b", "low", 3), deleted=False, nudge=False)
    api.meanwhile(LEDGER_PATH, deposed_leader_writes)  # just before our next write lands
    clock.now += 1
    loop.pass_once()
    first, second = api.puts[-2:]
    assert (
        int(second["metadata"]["resourceVersion"]) == int(first["metadata"]["resourceVersion"]) + 1
    )
    assert f"{LEDGER_PATH}" in api.gets  # read again after the 409
    # Decided again on the re-read ledger: vip holds the slot, a and b wait.
    assert states(api)[f"{NS}/vip"] == ("Granted", "SlotFree")
    assert states(api)[f"{NS}/a"][0] == "Queued"
    assert states(api)[f"{NS}/b"][0] == "Queued"


def test_a_ledger_an_earlier_engine_of_the_name_left_is_replaced_not_read(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    stale = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "GrantLedger",
        "metadata": {"namespace": NS, "name": "coder", "resourceVersion": "3", "uid": "l-old",
                     "ownerReferences": [{"kind": "Engine", "name": "coder", "uid": "u-0"}]},
        "status": {"grants": [{"mind": f"{NS}/old", "state": "Granted", "slot": 0,
                               "tokens": 512}]},
    }  # fmt: skip
    api.add(stale, "grantledgers")
    api, loop, _ = setup(tmp_path, mind("a", "low", 1), api=api)
    asyncio.run(seed_ledgers(api.aio, loop.engines))  # type: ignore[arg-type]
    assert "grantLedger" not in loop.engines.engines[(NS, "coder")]  # another owner: not merged
    loop.pass_once()
    assert ("DELETE", LEDGER_PATH) in api.requests
    owners = the_ledger(api)["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == ["u-1"]
    assert states(api) == {f"{NS}/a": ("Granted", "SlotFree")}  # the old mind's slot is not hers


def test_a_new_leader_reads_the_ledgers_before_its_first_step(tmp_path: Path) -> None:
    api, loop, _ = setup(tmp_path, mind("a", "low", 1))
    loop.pass_once()
    written = len(api.puts)
    # A new leader: a cache with the Engine and its Minds, not (yet) the ledger's watch event.
    engines = Cache()
    join_caches(engines, loop.minds)
    engines.observe_engine(api.objects[ENGINE_PATH], deleted=False, nudge=False)
    settings = GrantSettings(transition_log=tmp_path / "log2.jsonl", write_workers=1)
    again = GrantsLoop(api.aio, settings, engines, loop.minds, clock=loop.clock)  # type: ignore[arg-type]
    asyncio.run(seed_ledgers(api.aio, engines))  # type: ignore[arg-type]
    again.pass_once()
    assert len(api.created) == 1 and len(api.puts) == written  # nothing to change, nothing written
    assert states(api) == {f"{NS}/a": ("Granted", "SlotFree")}


def test_an_api_server_without_the_grantledger_kind_is_told_how_to_install_it(
    tmp_path: Path, caplog: Any
) -> None:
    api, loop, _ = setup(tmp_path, mind("a", "low", 1))
    real = api.aio.request

    async def without_the_crd(method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if "/grantledgers" in path:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return await real(method, path, body, **kw)

    api.aio.request = without_the_crd  # type: ignore[method-assign]
    with pytest.raises(ApiError) as listed:
        asyncio.run(seed_ledgers(api.aio, loop.engines))  # type: ignore[arg-type]
    assert "apply this release's CRDs" in str(listed.value)
    with caplog.at_level("ERROR", logger="continuum.grants"):
        asyncio.run(loop.drain())  # the kernel retries the Engine after its backoff
    assert "no GrantLedger kind (grantledgers.continuum.dev)" in caplog.text
    assert "helm upgrade" in caplog.text


def test_a_late_event_of_a_replaced_ledger_does_not_undo_its_successor() -> None:
    engines = Cache()
    engines.observe_engine(engine_body(), deleted=False, nudge=False)

    def ledger(uid: str, version: str, holder: str) -> dict[str, Any]:
        meta = {"namespace": NS, "name": "coder", "uid": uid, "resourceVersion": version}
        return {"metadata": meta, "status": {"grants": [{"mind": holder, "state": "Granted"}]}}

    new = ledger("l-new", "90", f"{NS}/a")
    engines.observe_ledger(new, deleted=False, nudge=False)
    # The watch still delivers the earlier ledger's last change, then its deletion.
    engines.observe_ledger(ledger("l-old", "70", f"{NS}/old"), deleted=False, nudge=False)
    engines.observe_ledger(ledger("l-old", "80", f"{NS}/old"), deleted=True, nudge=False)
    body = engines.engines[(NS, "coder")]
    assert body["status"]["grants"] == new["status"]["grants"]
    assert body["grantLedger"]["uid"] == "l-new"


def test_an_engine_with_no_mind_gets_its_ledger_so_its_gateway_has_a_table(
    tmp_path: Path,
) -> None:
    # The gateway has no table (and its pod is not ready) until the ledger names a slot size:
    # the first step writes the pool even with no mind to grant.
    api, loop, _ = setup(tmp_path)
    loop.pass_once()
    table = table_from_ledger(the_ledger(api))
    assert table.slot_tokens == 512 and dict(table.entries) == {}
    assert the_ledger(api)["status"]["grantCapacity"]["phase"] == "Serving"
