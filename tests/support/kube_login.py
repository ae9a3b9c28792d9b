"""What the tests of the API adapters log in with: a kubeconfig naming a server on this machine
(plain http) with a bearer token, and a meter that records each request as the operator's
metrics would."""

from __future__ import annotations

import json
from pathlib import Path

TOKEN = "the-token"


def kubeconfig(path: Path, port: int) -> str:
    """A kubeconfig at `path` for http://127.0.0.1:`port`, its user's token `TOKEN`."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))
    return str(path)


class Meter:
    """Records "VERB resource" as each request goes, and "answered VERB resource" once its
    answer is read (any status)."""

    def __init__(self, counted: list[str] | None = None) -> None:
        self.counted = counted if counted is not None else []

    def record_api_request(self, verb: str, resource: str) -> None:
        self.counted.append(f"{verb} {resource}")

    def record_api_answer(self, verb: str, resource: str, seconds: float) -> None:
        assert 0 <= seconds < 30
        self.counted.append(f"answered {verb} {resource}")
