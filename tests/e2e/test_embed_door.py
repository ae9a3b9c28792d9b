"""An embed lane's door on the real API server (docs/embedlanes.md, "The door"):
`continuum embed --lane NS/NAME`, as the operator's pod runs it, reviews each caller's token with
a TokenReview for the lane's audience. Tokens are made with `kubectl create token SA --audience`:
a service account of the lane's namespace with the lane's audience is served; the API server's
audience, an engine's audience, or no token is 401; a service account of another namespace is
403. `/metrics` and `/v1/runtime` answer on the admin port only. And the lane's identity, as
the operator applies it, may create TokenReviews, which it may not without it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from continuum_operator import yaml_text
from continuum_operator.engine.admission import engine_audience, lane_audience
from tests.support.builders import ROOT
from tests.support.cluster import Cluster
from tests.support.local_http import post_embeddings

pytestmark = pytest.mark.e2e

LANE = "notes"


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code)


@pytest.fixture
def other_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-lane-other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl(
            "delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False
        )


def test_the_lane_serves_its_namespaces_accounts_by_token_and_refuses_the_rest(
    cluster: Cluster, namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    import openai

    from continuum_operator.testing import TinyModelShape, write_tiny_gguf
    from tests.support.llama_server import import_llama_cpp
    from tests.support.local_http import free_port, http_json

    import_llama_cpp()
    shape = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=512, context_length=4096, embedding=True)  # fmt: skip
    model = write_tiny_gguf(tmp_path / "tiny-embed.gguf", shape, seed=3)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/embedlanes.continuum.dev"
    )
    # The lane as the operator leaves it once placed: its lease in status.placement (written
    # here by hand: no operator in this test; an Engine of that name does not exist, so one
    # that runs keeps this placement and says EngineNotFound).
    cluster.apply(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": LANE, "namespace": namespace},
         "spec": {"engine": "none-such", "maxContextTokens": 1024}}
    )  # fmt: skip
    placement = {"node": "n", "verdict": "Fits", "residence": "host", "contextTokens": 1024}
    leased = json.dumps({"status": {"placement": placement}})
    cluster.kubectl("patch", "embedlane", LANE, "-n", namespace, "--subresource=status",
                    "--type=merge", "-p", leased)  # fmt: skip
    for ns in (namespace, other_namespace):
        cluster.kubectl("create", "serviceaccount", "writer", "-n", ns)

    def token(ns: str, *audiences: str) -> str:
        flags = [f"--audience={a}" for a in audiences]
        made = cluster.kubectl("create", "token", "writer", "-n", ns, *flags).stdout
        return str(made).strip()

    audience = lane_audience(namespace, LANE)
    own = token(namespace, audience)
    plain = token(namespace)  # the API server's audience only
    engines = token(namespace, engine_audience(namespace, LANE))
    elsewhere = token(other_namespace, audience)

    port, admin_port = free_port(), free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    log_path = tmp_path / "embed.log"
    with log_path.open("wb") as log:
        # No review flag: review is the default with --lane, as in the operator's pod.
        proc = subprocess.Popen(
            [sys.executable, "-m", "continuum_operator.cli", "embed", "--model", str(model),
             "--lane", f"{namespace}/{LANE}", "--listen", f"127.0.0.1:{port}",
             "--admin-listen", f"127.0.0.1:{admin_port}"],
            stdout=log, stderr=subprocess.STDOUT, env=cluster.env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "never ready:\n" + log_path.read_text()
                try:
                    if http_json(f"{url}/readyz", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.3)
            body = {"input": ["hello", "a second text"]}
            code, doc = post_embeddings(url, body, own)
            assert code == 200, doc
            assert len(doc["data"]) == 2 and len(doc["data"][0]["embedding"]) == shape.n_embd

            refusals = {
                "no token": (None, 401, "unauthenticated"),
                "the API server's audience": (plain, 401, "unauthenticated"),
                "an engine's audience": (engines, 401, "unauthenticated"),
                "another namespace's account": (elsewhere, 403, "forbidden"),
                "not a token": ("forged", 401, "unauthenticated"),
            }
            for what, (bearer, status, code_name) in refusals.items():
                code, doc = post_embeddings(url, body, bearer)
                assert (code, doc["error"]["code"]) == (status, code_name), (what, doc)
                assert doc["error"]["message"] and doc["error"]["type"], (what, doc)
            code, doc = post_embeddings(url, body, elsewhere)
            assert f"{other_namespace}/writer" in doc["error"]["message"]

            # The official client: the token is its API key.
            with openai.OpenAI(base_url=f"{url}/v1", api_key=own, max_retries=0) as client:
                done = client.embeddings.create(model="any", input="hello")
                assert len(done.data[0].embedding) == shape.n_embd
            with (
                openai.OpenAI(base_url=f"{url}/v1", api_key=plain, max_retries=0) as nobody,
                pytest.raises(openai.AuthenticationError),
            ):
                nobody.embeddings.create(model="any", input="hello")

            # Its report and metrics on the admin port, not the serving one.
            for path in ("/metrics", "/v1/runtime"):
                assert status_of(f"{url}{path}") == 404, path
                assert status_of(f"{admin}{path}") == 200, path
            code, runtime = http_json(f"{admin}/v1/runtime")
            assert runtime["requests"]["served"] == 2  # refused callers are not the lane's load
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_the_lanes_identity_and_network_policy_are_accepted_and_let_it_review_tokens(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """What the operator applies for a lane, applied to the real API server: its
    ServiceAccount may create TokenReviews (through system:auth-delegator) and could not
    before; the NetworkPolicy is a valid one admitting the lane's namespace."""
    from continuum_operator.kube.base.settings import PodSettings
    from continuum_operator.kube.workloads import lane_objects
    from continuum_operator.model.embedlane import EmbedLane

    lane = EmbedLane.model_validate(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": LANE, "namespace": namespace},
         "spec": {"engine": "coder", "maxContextTokens": 1024}}
    )  # fmt: skip
    who = f"--as=system:serviceaccount:{namespace}:{lane_objects.deployment_name(lane)}"

    def can_review() -> str:
        found = cluster.kubectl("auth", "can-i", "create", "tokenreviews", who, check=False)
        return str(found.stdout).strip()

    assert can_review() == "no"
    built = [
        *lane_objects.lane_identity(lane, "uid"),
        lane_objects.lane_network_policy(lane, "uid", PodSettings()),
    ]
    for obj in built:  # no EmbedLane here to own them: the garbage collector would take them
        obj["metadata"].pop("ownerReferences", None)
    path = tmp_path / "identity.yaml"
    path.write_text(yaml_text.dump_all(built))
    cluster.kubectl("apply", "--server-side", "--field-manager=e2e", "-f", str(path))
    try:
        assert can_review() == "yes"
        name = lane_objects.deployment_name(lane)
        policy = cluster.get_json("networkpolicy", name, "-n", namespace)
        callers, admin = policy["spec"]["ingress"]
        [expr] = callers["from"][0]["namespaceSelector"]["matchExpressions"]
        assert expr["values"] == [namespace]
        assert [p["port"] for p in admin["ports"]] == [9090]
    finally:
        binding = lane_objects.token_review_binding_name(lane)
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found")
