"""A Mind's pod for the real node's tests and the demo: a pod under her ServiceAccount that takes
one turn at the address in her status, as an unmodified OpenAI client would (`POST
/v1/chat/completions`, her projected token with the engine's audience as the API key), and
prints what came back as one JSON line. Only the Python standard library runs in the pod (the
engine image's interpreter), so the pod shows what any agent's client gets.

Neighbours: `engine.admission.engine_audience` names the audience the gateway checks;
`tests/e2e/test_real_node.py` and `tools/demo.py` create these pods and read their logs.
"""

from __future__ import annotations

from typing import Any

from continuum_operator.engine.admission import engine_audience

__all__ = ["TOKEN_PATH", "mind_pod", "service_account"]

TOKEN_PATH = "/var/run/continuum/token"

# Runs in the pod: one chat request, streamed, every event kept; prints a JSON summary.
_CLIENT = r"""
import json, os, sys, time, urllib.error, urllib.request
endpoint, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
token = open(os.environ["TOKEN_PATH"]).read().strip()
body = {"model": "continuum", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "stream": True}
req = urllib.request.Request(endpoint.rstrip("/") + "/v1/chat/completions",
    data=json.dumps(body).encode(), method="POST",
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + token})
out = {"status": None, "text": "", "events": 0, "last": None, "error": None}
start = time.monotonic()
def connect():
    # As OpenAI's clients do, a refused connection is tried again (an engine pod replaced by a
    # relaunch is away for seconds), up to 60 s; an HTTP answer is never retried.
    while True:
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError:
            raise
        except urllib.error.URLError:
            if time.monotonic() - start > 60:
                raise
            time.sleep(1)
try:
    with connect() as resp:
        out["status"] = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            out["events"] += 1
            out["last"] = event
            for choice in event.get("choices", []):
                out["text"] += (choice.get("delta") or {}).get("content") or ""
except urllib.error.HTTPError as e:
    out["status"] = e.code
    out["error"] = e.read().decode(errors="replace")[:2000]
except Exception as e:
    out["error"] = repr(e)
out["seconds"] = round(time.monotonic() - start, 3)
print(json.dumps(out), flush=True)
"""


def service_account(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace}}  # fmt: skip


def mind_pod(
    *,
    name: str,
    namespace: str,
    service_account_name: str,
    engine_namespace: str,
    engine_name: str,
    endpoint: str,
    image: str,
    prompt: str,
    max_tokens: int,
    labels: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The pod that takes her turn; it ends when the turn does (restartPolicy Never).

    `node_selector` keeps it on real nodes where fake ones stand beside them: a KWOK node
    takes any pod and shows it Running forever, so a turn scheduled there never ends (the
    demo's and the real node's tests' turns hung so, in about half their runs)."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "serviceAccountName": service_account_name,
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "mind",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", _CLIENT, endpoint, prompt, str(max_tokens)],
                    "env": [{"name": "TOKEN_PATH", "value": TOKEN_PATH}],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                    "volumeMounts": [
                        {
                            "name": "token",
                            "mountPath": TOKEN_PATH.rsplit("/", 1)[0],
                            "readOnly": True,
                        }
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "token",
                    "projected": {
                        "sources": [
                            {
                                "serviceAccountToken": {
                                    "audience": engine_audience(engine_namespace, engine_name),
                                    "expirationSeconds": 3600,
                                    "path": TOKEN_PATH.rsplit("/", 1)[1],
                                }
                            }
                        ]
                    },
                }
            ],
        },
    }
    if node_selector:
        body["spec"]["nodeSelector"] = dict(node_selector)
    return body
