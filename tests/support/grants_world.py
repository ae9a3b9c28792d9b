"""The grants loop against a fake API server: a world of Engines, Minds, classes and quotas
(`World`), for the tests of grants, tenancy and Mind status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.grants.loop import GrantsLoop
from continuum_operator.kube.process.run import join_caches
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.mind_cache import MindCache
from tests.support.builders import stored_ledger
from tests.support.fakes import FakeKubeApi

BASE = "/apis/continuum.dev/v1alpha1/namespaces"


def engine(ns: str, name: str, slots: int = 2, allowed: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"contextTokensPerMind": 1000}
    if allowed is not None:
        spec["allowedNamespaces"] = allowed
    return {
        "metadata": {"namespace": ns, "name": name, "resourceVersion": "10"},
        "spec": spec,
        "status": {
            "plan": {"node": "n", "engineArgs": ["-np", str(slots)], "mindsGrantable": slots,
                     "contextTokensPerMind": 1000},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }  # fmt: skip


def mind(ns: str, name: str, engine: str, second: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "resourceVersion": "1",
                     "creationTimestamp": f"2026-12-03T06:00:{second:02d}Z"},
        "spec": {"engine": engine, "contextTokens": 256, **spec},
    }  # fmt: skip


def quota(ns: str, name: str, max_tokens: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "resourceVersion": "1", "generation": 1},
        "spec": {"maxTokens": max_tokens},
    }


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.api = FakeKubeApi()
        self.engines = Cache()
        self.cache = MindCache()
        join_caches(self.engines, self.cache)
        settings = GrantSettings(transition_log=tmp_path / "log.jsonl", write_workers=2)
        self.loop = GrantsLoop(
            self.api.aio,  # type: ignore[arg-type]
            settings,
            self.engines,
            self.cache,
            clock=lambda: 1_000.0,
        )

    def engine(self, body: dict[str, Any]) -> None:
        self.api.add(body, "engines")
        self.engines.observe_engine(body, deleted=False, nudge=False)

    def mind(self, body: dict[str, Any]) -> None:
        self.api.add(body, "minds")
        self.cache.observe_mind(body, deleted=False, nudge=False)

    def quota(self, body: dict[str, Any]) -> None:
        self.api.add(body, "tokenquotas")
        self.cache.observe_quota(body, deleted=False, nudge=False)

    def cls(self, name: str, **spec: Any) -> None:
        self.cache.classes[name] = {"metadata": {"name": name}, "spec": {"priority": 0, **spec}}

    def ledger(self, ns: str, name: str) -> dict[str, tuple[str, str]]:
        status = stored_ledger(self.api.objects, ns, name)
        return {e["mind"]: (e["state"], e["reason"]) for e in status.get("grants") or []}

    def status(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        return dict(self.api.objects[f"{BASE}/{ns}/{plural}/{name}"].get("status") or {})

    def granted(self, ns: str, name: str) -> dict[str, Any]:
        conds = self.status("minds", ns, name).get("conditions") or []
        return next(c for c in conds if c["type"] == "Granted")
