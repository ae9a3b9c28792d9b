"""Whether an operator replica may be sent work: `GET /readyz` beside `/metrics`.

The Service in front of the replicas sends the API server's admission reviews (the children's
webhook, `kube.children.webhook`) to ready replicas only. A replica answering before it has listed
the Minds would take a pod her service account creates for an ordinary pod: admitted at full
priority and CPU weight, unlabelled, so not counted either. So a replica is ready once the
things it waits for are done (the Minds listed, its webhook serving and configured), and
`/metrics` answers from the start, as liveness and Prometheus want."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

if TYPE_CHECKING:  # the standard WSGI types, as typeshed names them
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["MINDS_LISTED", "WEBHOOK_SERVING", "Readiness", "serve_metrics"]

MINDS_LISTED = "the Minds listed"
WEBHOOK_SERVING = "the children's webhook serving"


class Readiness:
    """What a replica still waits for. `done` is called on the event loop and `waiting` read
    from the HTTP server's threads: the set is replaced whole, never changed in place."""

    def __init__(self, waits_for: Iterable[str] = ()) -> None:
        self._waiting = frozenset(waits_for)

    def done(self, what: str) -> None:
        self._waiting = self._waiting - {what}

    def waiting(self) -> tuple[str, ...]:
        return tuple(sorted(self._waiting))


def routed(metrics: WSGIApplication, readiness: Readiness) -> WSGIApplication:
    """`/readyz` answered from `readiness` (200, or 503 naming what it waits for); any other
    path to the metrics app, as prometheus_client serves it."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/readyz":
            yield from metrics(environ, start_response)
            return
        waiting = readiness.waiting()
        status = "503 Service Unavailable" if waiting else "200 OK"
        body = (f"waiting for {', '.join(waiting)}\n" if waiting else "ok\n").encode()
        headers = [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
        ]
        start_response(status, headers)
        yield body

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # a probe every few seconds
        pass


def serve_metrics(
    port: int, registry: CollectorRegistry, readiness: Readiness, addr: str = "0.0.0.0"
) -> None:
    """`/metrics` and `/readyz` on `port`, from a daemon thread (as `prometheus_client`'s own
    `start_http_server`, which cannot be given a second path)."""
    app = routed(make_wsgi_app(registry), readiness)
    httpd = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
