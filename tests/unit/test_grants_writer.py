"""The leader's ledger writes (`kube.minds.GrantsLoop`) against a stand-in API server: a replace
of the Engine's status carrying its resourceVersion, never a blind merge; on 409 the Engine is
read again and the step decided again on what it now says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from continuum_operator.kube.cache import Cache
from continuum_operator.kube.grant_settings import GrantSettings
from continuum_operator.kube.mind_cache import MindCache
from continuum_operator.kube.minds import GrantsLoop
from tests.fakes import FakeKubeApi

NS = "minds"
ENGINE_PATH = f"/apis/continuum.dev/v1alpha1/namespaces/{NS}/engines/coder"


def engine_body() -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"namespace": NS, "name": "coder", "resourceVersion": "10"},
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


def setup(tmp_path: Path, *minds: dict[str, Any]) -> tuple[FakeKubeApi, GrantsLoop, Clock]:
    """One Engine with a resourceVersion, and no Mind at the API server: their projections
    are not under test here (each write of one is a 404)."""
    api = FakeKubeApi([engine_body()])
    engines, cache = Cache(), MindCache()
    engines.observe_engine(the_engine(api), deleted=False, nudge=False)
    for m in minds:
        cache.observe_mind(m, deleted=False, nudge=False)
    for name, priority in (("low", 0), ("high", 10)):
        spec = {"priority": priority, "protectionWindowSeconds": 0}
        cache.classes[name] = {"metadata": {"name": name}, "spec": spec}
    clock = Clock()
    settings = GrantSettings(transition_log=tmp_path / "log.jsonl", write_workers=1)
    loop = GrantsLoop(api.aio, settings, engines, cache, clock=clock)  # type: ignore[arg-type]
    return api, loop, clock


def the_engine(api: FakeKubeApi) -> dict[str, Any]:
    return api.objects[ENGINE_PATH]


def states(api: FakeKubeApi) -> dict[str, tuple[str, str]]:
    return {e["mind"]: (e["state"], e["reason"]) for e in the_engine(api)["status"]["grants"]}


def test_the_ledger_is_written_as_a_replace_carrying_the_resource_version(tmp_path: Path) -> None:
    api, loop, _ = setup(tmp_path, mind("a", "low", 1))
    loop.pass_once()
    [put] = api.puts
    assert put["metadata"]["resourceVersion"] == "10"
    assert put["status"]["plan"]["mindsGrantable"] == 1  # the whole status, others' parts kept
    assert states(api) == {f"{NS}/a": ("Granted", "SlotFree")}
    assert the_engine(api)["status"]["grantStep"]["seq"] == 1


def test_a_conflict_is_read_again_and_decided_again_on_what_the_engine_now_says(
    tmp_path: Path,
) -> None:
    api, loop, clock = setup(tmp_path, mind("a", "low", 1))
    loop.pass_once()
    loop.minds.observe_mind(mind("vip", "high", 2), deleted=False, nudge=False)
    clock.now += 1
    loop.pass_once()  # a is preempted: Reclaiming
    assert states(api)[f"{NS}/a"] == ("Reclaiming", "Preempted")
    since = next(e["since"] for e in the_engine(api)["status"]["grants"] if e["mind"] == f"{NS}/a")

    def gateway_reports_release(engine: dict[str, Any]) -> None:
        engine["status"]["runtime"] = {
            "slotReleases": [{"mind": f"{NS}/a", "slot": 0, "grantSince": since}]
        }  # (the double bumps its resourceVersion, as this write would)

    # Another pass while the gateway writes its release report between our read and our write.
    loop.engines.observe_engine({**the_engine(api), "metadata": {**the_engine(api)["metadata"]}},
                                deleted=False, nudge=False)  # fmt: skip
    loop.minds.observe_mind(mind("b", "low", 3), deleted=False, nudge=False)
    api.meanwhile(ENGINE_PATH, gateway_reports_release)  # just before our next write lands
    clock.now += 1
    loop.pass_once()
    first, second = api.puts[-2:]
    assert (
        int(second["metadata"]["resourceVersion"]) == int(first["metadata"]["resourceVersion"]) + 1
    )
    # Decided again on the re-read Engine: the release is recorded, vip takes the slot.
    assert states(api)[f"{NS}/a"] == ("Queued", "PoolFull")
    assert states(api)[f"{NS}/vip"] == ("Granted", "SlotFree")
    assert the_engine(api)["status"]["runtime"]["slotReleases"]  # the runtime's part, kept
