"""HTTP on this machine's loopback, through the standard library only: a free port to serve on,
a JSON request that never raises on an HTTP error status (`http_json`), and an embeddings request
with a bearer token (`post_embeddings`)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


def http_json(
    url: str, body: dict[str, Any] | None = None, *, timeout: float = 30.0
) -> tuple[int, Any]:
    """GET (or POST `body` as JSON) and return (status, decoded JSON or text); never raises on
    an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            status, raw = err.code, err.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post_embeddings(url: str, body: dict[str, Any], token: str | None) -> tuple[int, Any]:
    """POST /v1/embeddings with `token` as the bearer token (the OpenAI client's API key);
    (status, decoded JSON), never raising on an HTTP error status."""
    req = urllib.request.Request(
        f"{url}/v1/embeddings", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())
