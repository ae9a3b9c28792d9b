"""`KubeApi`, the blocking adapter (the leader's Lease, the CLI), against an HTTP server on this
machine: each verb sends what the async adapter sends (method, path, query, headers, the token,
a JSON body); a log comes as text with the API server's error let through (not a bare 406); the
server's Status is raised as `ApiError`; a server that cannot be reached is an `OSError`, as the
leader's outage handling expects."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from continuum_operator.kube.client.api import ApiError, KubeApi
from tests.support.kube_login import TOKEN, Meter, kubeconfig

LOG = "/api/v1/namespaces/ns/pods/p/log"

# Each request the server saw: method, path, query, headers, body.
Seen = list[tuple[str, str, dict[str, str], dict[str, str], str]]


class Handler(BaseHTTPRequestHandler):
    seen: Seen

    def _answer(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode()
        self.seen.append((self.command, url.path, dict(parse_qsl(url.query)),
                          dict(self.headers.items()), body))  # fmt: skip
        if url.path == LOG and self.command == "GET":
            self._send(200, b"line one\n", "text/plain")
        elif url.path.endswith("/waiting/log"):
            message = 'container "facts" is waiting to start: ContainerCreating'
            status = {"kind": "Status", "reason": "BadRequest", "message": message}
            self._send(400, json.dumps(status).encode())
        elif self.command == "DELETE":
            self._send(404, json.dumps({"kind": "Status", "reason": "NotFound"}).encode())
        elif self.command == "PUT":
            status = {"kind": "Status", "reason": "Conflict", "message": "has been modified"}
            self._send(409, json.dumps(status).encode())
        else:
            self._send(
                200, json.dumps({"kind": "Thing", "echo": json.loads(body or "null")}).encode()
            )

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

    def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def server(tmp_path: Path) -> Iterator[tuple[KubeApi, Seen, Meter]]:
    seen: Seen = []
    handler = type("Recording", (Handler,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    meter = Meter()
    try:
        yield (
            KubeApi(kubeconfig(tmp_path / "kubeconfig", httpd.server_address[1]), meter),
            seen,
            meter,
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_each_verb_sends_what_the_async_adapter_sends(tmp_path: Path) -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": "d", "namespace": "ns"}}  # fmt: skip
    with server(tmp_path) as (api, seen, meter):
        assert api.apply(deployment)["echo"] == deployment
        api.merge_patch("/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status",
                        {"status": {"x": 1}})  # fmt: skip
        api.create(deployment)
        listed = api.request("GET", "/api/v1/pods", query=[("labelSelector", "a=b")])
        assert listed["kind"] == "Thing"
        api.delete("/apis/apps/v1/namespaces/ns/deployments/d")  # 404: already gone
    assert [(m, p) for m, p, *_ in seen] == [
        ("PATCH", "/apis/apps/v1/namespaces/ns/deployments/d"),
        ("PATCH", "/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status"),
        ("POST", "/apis/apps/v1/namespaces/ns/deployments"),
        ("GET", "/api/v1/pods"),
        ("DELETE", "/apis/apps/v1/namespaces/ns/deployments/d"),
    ]
    assert seen[0][2] == {"fieldManager": "continuum-operator", "force": "true"}
    assert seen[0][3]["Content-Type"] == "application/apply-patch+yaml"
    assert json.loads(seen[0][4]) == deployment
    assert seen[1][3]["Content-Type"] == "application/merge-patch+json"
    assert seen[3][2] == {"labelSelector": "a=b"}
    assert seen[4][2] == {"propagationPolicy": "Background"}
    assert {h["Authorization"] for *_, h, _ in seen} == {f"Bearer {TOKEN}"}
    sent = ["PATCH deployments", "PATCH engines/status", "POST deployments", "GET pods",
            "DELETE deployments"]  # fmt: skip
    assert meter.counted == [x for each in sent for x in (each, f"answered {each}")]


def test_a_log_is_asked_for_as_text_with_json_errors_accepted(tmp_path: Path) -> None:
    with server(tmp_path) as (api, seen, _):
        assert api.text(LOG) == "line one\n"
        with pytest.raises(ApiError) as raised:
            api.text("/api/v1/namespaces/ns/pods/waiting/log")
    accepted = [a.strip() for a in seen[0][3]["Accept"].split(",")]
    assert accepted == ["text/plain", "application/json"]
    assert raised.value.status == 400
    assert "waiting to start" in str(raised.value) and "BadRequest" in str(raised.value)


def test_the_servers_status_is_raised_with_its_code_and_reason(tmp_path: Path) -> None:
    with server(tmp_path) as (api, _, _), pytest.raises(ApiError) as raised:
        api.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/n/leases/l", {})
    assert raised.value.status == 409 and raised.value.reason == "Conflict"
    assert "has been modified" in str(raised.value)


def test_a_server_that_cannot_be_reached_is_an_os_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = KubeApi(kubeconfig(tmp_path / "kubeconfig", port))
    with pytest.raises(OSError, match="GET /api/v1/pods"):
        api.request("GET", "/api/v1/pods")
