"""`continuum release-finalizers` (the chart's pre-delete hook): the operator is stopped first,
then its finalizer comes off every Mind and nothing else does. Against an in-memory API that
keeps resourceVersions as the API server does (tests/e2e/test_uninstall.py runs the command on
the real one)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

from continuum_operator.kube.grants import mind_writes
from continuum_operator.kube.process import release
from tests.support.builders import ROOT
from tests.support.fakes import FakeKubeApi

GRANT = "continuum.dev/grant"


OPERATOR = "/apis/apps/v1/namespaces/sys/deployments/op"


class FakeApi(FakeKubeApi):
    """Minds, and the operator's Deployment (sys/op) whose pods go one each time they are
    listed once it is scaled to none (3 while it runs)."""

    def __init__(self, objects: Sequence[dict[str, Any]]) -> None:
        super().__init__()
        for obj in objects:
            self.add(obj, "minds")
        self.add(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"namespace": "sys", "name": "op", "resourceVersion": "1"},
                "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "op"}}},
            }
        )
        self.pods = 0

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if not path.endswith("/pods"):
            return super().request(method, path, body, query=query, content_type=content_type)
        self._record(method, path, body, query)
        assert dict(query)["labelSelector"] == "app=op"
        self.pods = max(0, self.pods - 1)  # one goes each time we look
        return {"items": [{}] * (self.pods if self.replicas == 0 else 3)}

    @property
    def replicas(self) -> int:
        return int(self.objects[OPERATOR]["spec"]["replicas"])


def mind(name: str, *finalizers: str, ns: str = "team") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "resourceVersion": "1",
            "finalizers": list(finalizers),
        }
    }


def finalizers_of(api: FakeApi, name: str, ns: str = "team") -> list[str]:
    path = f"/apis/continuum.dev/v1alpha1/namespaces/{ns}/minds/{name}"
    return list(api.objects[path]["metadata"]["finalizers"])


def test_the_grant_finalizer_comes_off_every_mind_and_other_finalizers_stay() -> None:
    api = FakeApi(
        [
            mind("a", GRANT),
            mind("b", "example.com/keep", GRANT),
            mind("c"),
            mind("d", GRANT, ns="other"),
        ]
    )
    done = release.release_finalizers(api)
    assert done.seen == 4
    assert sorted(done.released) == ["minds other/d", "minds team/a", "minds team/b"]
    assert finalizers_of(api, "a") == []
    assert finalizers_of(api, "b") == ["example.com/keep"]
    assert finalizers_of(api, "c") == []
    assert finalizers_of(api, "d", "other") == []


def test_a_mind_changed_meanwhile_is_read_again_and_keeps_the_new_finalizer() -> None:
    api = FakeApi([mind("a", GRANT)])
    path = "/apis/continuum.dev/v1alpha1/namespaces/team/minds/a"
    api.meanwhile(  # written between our read and our patch
        path, lambda m: m["metadata"].update(finalizers=[GRANT, "example.com/new"])
    )
    done = release.release_finalizers(api)
    assert done.released == ["minds team/a"]
    assert finalizers_of(api, "a") == ["example.com/new"]


def test_every_page_of_minds_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(release, "PAGE", 2)
    api = FakeApi([mind(f"m{i}", GRANT) for i in range(5)])
    assert len(release.release_finalizers(api).released) == 5


def test_the_operator_is_stopped_before_any_finalizer_comes_off() -> None:
    api = FakeApi([mind("a", GRANT)])
    api.pods = 3
    waited = release.stop_operator(api, "sys", "op", timeout=60, sleep=lambda _: None)
    assert api.replicas == 0
    assert waited == 2  # it looked until no pod was left
    assert not any(m == "PATCH" and "/minds/" in p for m, p in api.requests)
    assert finalizers_of(api, "a") == [GRANT]


def test_an_operator_that_will_not_stop_is_an_error_that_says_so() -> None:
    api = FakeApi([])
    api.pods = 10**6
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(release.StopTimeout, match="would put the finalizers back"):
        release.stop_operator(api, "sys", "op", timeout=5, clock=lambda: now[0], sleep=sleep)


def test_a_missing_operator_deployment_is_nothing_to_stop() -> None:
    assert release.stop_operator(FakeApi([]), "sys", "gone", timeout=1) == 0


def test_the_list_covers_every_finalizer_the_operator_writes() -> None:
    """Each `finalizers` the operator writes is one FINALIZED names (a new one must be added)."""
    assert release.FINALIZED == (("minds", mind_writes.FINALIZER),)
    writers = []
    for path in (ROOT / "operator" / "continuum_operator").rglob("*.py"):
        text = path.read_text()
        if re.search(r"[\"']finalizers[\"']\s*:", text):
            writers.append(path.relative_to(ROOT).as_posix())
    assert sorted(writers) == [
        "operator/continuum_operator/kube/grants/mind_writes.py",
        "operator/continuum_operator/kube/process/release.py",
    ]
