"""`KubeApi.text` (a pod's log): the API server's error comes through, not a bare 406."""

from __future__ import annotations

import json
from typing import Any

import pytest

from continuum_operator.kube.client.api import ApiError, KubeApi


class Response:
    def __init__(self, status: int, data: bytes) -> None:
        self.status = status
        self.data = data

    def read(self) -> None:
        pass


class FakeClient:
    def __init__(self, status: int, data: bytes) -> None:
        self.answer = Response(status, data)
        self.headers: dict[str, str] = {}

    def param_serialize(self, method: str, path: str, **kw: Any) -> tuple[Any, ...]:
        self.headers = dict(kw["header_params"])
        return (method, path)

    def call_api(self, *request: Any, **_: Any) -> Response:
        return self.answer


def api_with(status: int, data: bytes) -> tuple[KubeApi, FakeClient]:
    api = KubeApi.__new__(KubeApi)
    api.meter = None
    fake = FakeClient(status, data)
    api._client = fake  # type: ignore[assignment]
    return api, fake


def test_a_log_is_asked_for_as_text_with_json_errors_accepted() -> None:
    api, fake = api_with(200, b"line one\nline two\n")
    assert api.text("/api/v1/namespaces/ns/pods/p/log") == "line one\nline two\n"
    accepted = [a.strip() for a in fake.headers["Accept"].split(",")]
    assert accepted == ["text/plain", "application/json"]


def test_the_api_servers_status_reason_and_message_are_raised() -> None:
    status = {
        "kind": "Status",
        "reason": "BadRequest",
        "message": 'container "facts" in pod "p" is waiting to start: ContainerCreating',
    }
    api, _ = api_with(400, json.dumps(status).encode())
    with pytest.raises(ApiError) as raised:
        api.text("/api/v1/namespaces/ns/pods/p/log")
    assert raised.value.status == 400
    assert "waiting to start" in str(raised.value) and "BadRequest" in str(raised.value)
