"""An embed lane's door (docs/embedlanes.md, "The door"): `POST /v1/embeddings` serves only a
bearer token the API server accepts for the lane's own audience, of a service account of the
lane's namespace; `/metrics` and `/v1/runtime` are on the admin port, never on the serving port;
the operator's pod turns review on and may review tokens.

The finding this guards: the lane's pod served embeddings to anyone who reached it, with no
identity check, and its metrics and runtime report on the same port.

The API server here is a fake that answers a TokenReview as the real one does (a token is
accepted only for an audience it was issued with); tests/e2e/test_embed_door.py asks the real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest

from continuum_operator.cli import build_parser
from continuum_operator.cli.embed import settings_from
from continuum_operator.door.serving import serve_app
from continuum_operator.door.token_review import TokenReviewer
from continuum_operator.embed import runtime as lane_runtime
from continuum_operator.embed.runtime import Door, LaneRuntime, LaneState, _door
from continuum_operator.engine.admission import engine_audience, lane_audience
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.client.api import path_of
from continuum_operator.kube.workloads import engine_identity, engine_objects, lane_objects
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from tests.support import builders
from tests.support.embed import WordModel
from tests.support.fake_apiserver import review_answer, reviewed_token
from tests.support.helm import by_kind, documents, find_helm, template

NS, LANE = "team-a", "notes"
AUDIENCE = lane_audience(NS, LANE)
#: Tokens the fake API server issued: (user name, audiences).
ISSUED = {
    "own": (f"system:serviceaccount:{NS}:writer", {AUDIENCE}),
    "own-plain": (f"system:serviceaccount:{NS}:writer", {"https://kubernetes.default.svc"}),
    "own-engine": (f"system:serviceaccount:{NS}:writer", {engine_audience(NS, LANE)}),
    "other-lane": (f"system:serviceaccount:{NS}:writer", {lane_audience(NS, "other")}),
    "elsewhere": ("system:serviceaccount:team-b:writer", {AUDIENCE}),
    "a-person": ("alice@example.com", {AUDIENCE}),
}


class FakeApiServer:
    """A TokenReview as the API server answers it: authenticated only for an audience the
    token was issued with, naming the audiences that matched."""

    def __init__(self) -> None:
        self.reviews: list[tuple[str, list[str]]] = []
        self.down = False  # unreachable: every review fails

    async def create(self, review: dict[str, Any], *, seconds: float | None = None) -> Any:
        token, asked = reviewed_token(review)
        self.reviews.append((token, asked))
        if self.down:
            raise ConnectionError("connection refused")
        user, audiences = ISSUED.get(token, ("", set()))
        matched = [a for a in asked if a in audiences]
        return review_answer(user if user and matched else None, matched)


@dataclass
class Rig:
    url: str
    admin: str
    http: aiohttp.ClientSession
    api: FakeApiServer
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    async def post(self, token: str | None, **headers: str) -> tuple[int, Any]:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        body = {"input": ["a b c"]}
        async with self.http.post(f"{self.url}/v1/embeddings", json=body, headers=headers) as r:
            return r.status, await r.json()

    async def get(self, url: str) -> int:
        async with self.http.get(url) as resp:
            return resp.status

    def client(self, api_key: str) -> openai.AsyncOpenAI:
        """The official client, as a caller makes it: the token is its API key."""
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client


def run(body: Callable[[Rig], Awaitable[None]], *, door: bool = True) -> None:
    api = FakeApiServer()

    async def scenario() -> None:
        reviewer = TokenReviewer(AUDIENCE, api=api)
        rt = LaneRuntime(
            WordModel(),  # type: ignore[arg-type]
            LaneState(max_context_tokens=1024, leased_context_tokens=512),
            door=Door(reviewer, AUDIENCE, NS) if door else None,
        )
        await rt.calibrate()
        runner, address = await serve_app(rt.app(), "127.0.0.1", 0)
        admin_runner, admin = await serve_app(rt.admin_app(), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http:
                rig = Rig(f"http://{address}", f"http://{admin}", http, api)
                try:
                    await body(rig)
                finally:
                    for client in rig.clients:
                        await client.close()
        finally:
            await runner.cleanup()
            await admin_runner.cleanup()

    asyncio.run(scenario())


@pytest.fixture(autouse=True)
def no_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_runtime, "gpu_offload_supported", lambda: False)
    monkeypatch.setattr(lane_runtime, "llama_build", lambda: "test")


def openai_error(doc: Any, reason: str, code: str) -> str:
    """The body is OpenAI's error shape, with the lane's reason kept beside it."""
    error = doc["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert (error["reason"], error["code"]) == (reason, code), error
    return str(error["message"])


class TestWhoIsServed:
    def test_no_token_is_401_saying_what_to_send(self) -> None:
        async def body(rig: Rig) -> None:
            status, doc = await rig.post(None)
            assert status == 401
            message = openai_error(doc, "Unauthenticated", "unauthenticated")
            assert AUDIENCE in message and f"namespace {NS}" in message
            assert "Authorization: Bearer" in message
            assert rig.api.reviews == []  # nothing to review
            # A token not sent as a bearer token is no token.
            status, _ = await rig.post(None, Authorization="Basic b3duOng=")
            assert status == 401

        run(body)

    @pytest.mark.parametrize(
        "token",
        ["own-plain", "own-engine", "other-lane", "forged", "a-person"],
        ids=["the-api-servers-audience", "an-engines", "another-lanes", "forged", "not-an-sa"],
    )
    def test_a_token_not_issued_for_this_lanes_audience_is_401(self, token: str) -> None:
        async def body(rig: Rig) -> None:
            status, doc = await rig.post(token)
            assert status == 401
            message = openai_error(doc, "Unauthenticated", "unauthenticated")
            assert "did not accept the token" in message and AUDIENCE in message
            # Reviewed with the lane's audience, and no other.
            assert rig.api.reviews == [(token, [AUDIENCE])]

        run(body)

    def test_a_service_account_of_another_namespace_is_403(self) -> None:
        async def body(rig: Rig) -> None:
            status, doc = await rig.post("elsewhere")
            assert status == 403
            message = openai_error(doc, "Forbidden", "forbidden")
            assert "team-b/writer" in message and f"only service accounts of namespace {NS}" in (
                message
            )

        run(body)

    def test_a_service_account_of_the_lanes_namespace_is_served(self) -> None:
        async def body(rig: Rig) -> None:
            status, doc = await rig.post("own")
            assert status == 200 and doc["data"][0]["embedding"] == [1.0, 0.0]
            # Answers are cached: a caller's requests do not each cost a review.
            assert (await rig.post("own"))[0] == 200
            assert rig.api.reviews == [("own", [AUDIENCE])]

        run(body)

    def test_a_token_the_api_server_could_not_review_is_503_to_send_again(self) -> None:
        # Not judged, so not a 401 (which tells her client to give up on a good token).
        async def body(rig: Rig) -> None:
            rig.api.down = True
            status, doc = await rig.post("own")
            assert status == 503
            message = openai_error(doc, "ReviewUnavailable", "review_unavailable")
            assert "connection refused" in message and "send the request again" in message
            rig.api.down = False
            assert (await rig.post("own"))[0] == 200  # the failure was not kept

        run(body)

    def test_the_openai_client_sends_the_token_as_its_api_key(self) -> None:
        async def body(rig: Rig) -> None:
            done = await rig.client("own").embeddings.create(model="any", input="hello there")
            assert done.data[0].embedding == [1.0, 0.0]
            with pytest.raises(openai.AuthenticationError) as no:
                await rig.client("own-engine").embeddings.create(model="any", input="x")
            assert AUDIENCE in no.value.message
            with pytest.raises(openai.PermissionDeniedError) as other:
                await rig.client("elsewhere").embeddings.create(model="any", input="x")
            assert "team-b/writer" in other.value.message

        run(body)

    def test_the_lanes_own_refusals_keep_their_reason_in_openais_shape(self) -> None:
        async def body(rig: Rig) -> None:
            big = {"input": " ".join(["w"] * 2000)}
            headers = {"Authorization": "Bearer own"}
            async with rig.http.post(f"{rig.url}/v1/embeddings", json=big, headers=headers) as r:
                assert r.status == 413
                doc = await r.json()
            openai_error(doc, "ContextTooLarge", "context_too_large")
            assert doc["error"]["type"] == "invalid_request_error"
            assert doc["error"]["tokens"] == 2001

        run(body)

    def test_without_a_door_anyone_is_served(self) -> None:
        # The --unsafe-no-review run: what the flag asks for, nothing more.
        async def body(rig: Rig) -> None:
            assert (await rig.post(None))[0] == 200

        run(body, door=False)


class TestTheAdminPort:
    def test_metrics_and_the_runtime_are_not_served_on_the_serving_port(self) -> None:
        async def body(rig: Rig) -> None:
            for path in ("/metrics", "/v1/runtime"):
                assert await rig.get(f"{rig.url}{path}") == 404, path
                assert await rig.get(f"{rig.admin}{path}") == 200, path
            for path in ("/healthz", "/readyz"):  # where the kubelet probes (port http)
                assert await rig.get(f"{rig.url}{path}") == 200, path
            # The admin port serves no embeddings.
            async with rig.http.post(f"{rig.admin}/v1/embeddings", json={"input": "x"}) as r:
                assert r.status in (404, 405)

        run(body)


def embed_args(*extra: str) -> Any:
    """`continuum embed`'s settings from its command line."""
    return settings_from(build_parser().parse_args(["embed", "--model", "m.gguf", *extra]))


class TestTheCommand:
    def test_a_lane_of_the_cluster_reviews_with_its_own_audience_and_namespace(self) -> None:
        door = _door(embed_args("--lane", f"{NS}/{LANE}"))
        assert door is not None and isinstance(door.review, TokenReviewer)
        assert door.audience == door.review.audience == "continuum.dev/embedlane/team-a/notes"
        assert door.namespace == NS

    def test_a_lanes_audience_is_not_an_engines_of_the_same_name(self) -> None:
        assert lane_audience(NS, LANE) != engine_audience(NS, LANE)
        assert lane_audience(NS, LANE) != lane_audience(NS, "other")

    def test_only_the_unsafe_flag_opens_the_door(self) -> None:
        assert _door(embed_args("--lane", f"{NS}/{LANE}", "--unsafe-no-review")) is None


def lane(name: str = LANE, namespace: str = NS) -> EmbedLane:
    return EmbedLane.model_validate(
        {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "EmbedLane",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"engine": "coder", "maxContextTokens": 1024},
        }
    )


def pod_of() -> dict[str, Any]:
    """The template of the lane's pod beside an engine whose model is a file."""
    body = builders.engine_body()
    body["spec"]["model"]["source"] = {"kind": "hostPath", "path": "/srv/models/embed.gguf"}
    body["metadata"] = {"name": "coder", "namespace": NS}
    placement = EmbedLanePlacement.model_validate(
        {"node": "n", "verdict": "Fits", "residence": "host", "pools": []}
    )
    engine = builders.engine(body)
    dep = lane_objects.lane_deployment(lane(), "u", placement, engine, PodSettings())
    return dict(dep["spec"]["template"])


class TestTheOperatorsPod:
    def test_its_pod_reviews_tokens_and_serves_metrics_on_the_admin_port(self) -> None:
        pod = pod_of()
        [container] = pod["spec"]["containers"]
        command = container["command"]
        assert command[:2] == ["continuum", "embed"] and "--unsafe-no-review" not in command
        # The pod's command through `continuum`'s own parser: review on, the lane's audience.
        args = build_parser().parse_args(command[1:])
        assert args.review_tokens and args.admin_port == engine_objects.ADMIN_PORT
        door = _door(settings_from(args))
        assert door is not None and (door.audience, door.namespace) == (AUDIENCE, NS)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": PodSettings().port, "admin": engine_objects.ADMIN_PORT}
        assert container["readinessProbe"]["httpGet"]["port"] == "http"  # /readyz stays there

    def test_its_identity_may_review_tokens(self) -> None:
        *namespaced, binding = lane_objects.lane_identity(lane(), "u")
        assert [o["kind"] for o in namespaced] == ["ServiceAccount", "Role", "RoleBinding"]
        assert binding["kind"] == "ClusterRoleBinding"
        assert binding["roleRef"]["name"] == engine_objects.AUTH_DELEGATOR
        [subject] = binding["subjects"]
        assert (subject["name"], subject["namespace"]) == (f"embedlane-{LANE}", NS)
        assert "ownerReferences" not in binding["metadata"]  # cluster-scoped: no namespaced owner
        assert binding["metadata"]["labels"][lane_objects.LANE_LABEL] == LANE
        assert binding["metadata"]["labels"]["continuum.dev/embedlane-namespace"] == NS
        assert path_of(binding) == (
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/"
            "continuum-embedlane-tokenreview%3Ateam-a%3Anotes"
        )

    def test_two_lanes_never_share_a_binding_nor_a_lane_and_an_engine(self) -> None:
        a, b = lane("b-c", "a"), lane("c", "a-b")
        assert lane_objects.token_review_binding_name(a) != lane_objects.token_review_binding_name(
            b
        )
        engine = builders.engine(
            {**builders.engine_body(), "metadata": {"name": LANE, "namespace": NS}}
        )
        assert lane_objects.token_review_binding_name(lane()) != (
            engine_identity.token_review_binding_name(engine)
        )

    def test_its_network_policy_admits_its_namespace_on_serving_and_scrapers_on_admin(
        self,
    ) -> None:
        policy = lane_objects.lane_network_policy(lane(), "u", PodSettings())
        assert path_of(policy) == (
            f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/embedlane-{LANE}"
        )
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "EmbedLane"
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_of()["metadata"]["labels"].items()
        callers, admin = spec["ingress"]
        [expr] = callers["from"][0]["namespaceSelector"]["matchExpressions"]
        assert (expr["key"], expr["values"]) == ("kubernetes.io/metadata.name", [NS])
        assert callers["ports"] == [{"protocol": "TCP", "port": PodSettings().port}]
        assert admin["ports"] == [{"protocol": "TCP", "port": engine_objects.ADMIN_PORT}]
        assert admin["from"] == [
            {"namespaceSelector": {"matchLabels": {engine_objects.SCRAPE_LABEL: "true"}}}
        ]

    def test_the_operator_applies_the_binding_and_policy_before_the_pod(self) -> None:
        from continuum_operator.kube.lanes.lane_pass import LaneWrites
        from continuum_operator.kube.lanes.loop import LaneLoop

        applied: list[str] = []

        async def apply(obj: dict[str, Any]) -> None:
            applied.append(obj["kind"])

        api = SimpleNamespace(apply=apply)
        loop = LaneLoop(api, None, None, lambda: 0.0)  # type: ignore[arg-type]
        writes = LaneWrites(
            None,
            deployment={"kind": "Deployment"},
            identity=tuple(lane_objects.lane_identity(lane(), "u")),
            network_policy=lane_objects.lane_network_policy(lane(), "u", PodSettings()),
        )
        asyncio.run(loop.apply_workload((NS, LANE), writes))
        assert applied == [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRoleBinding",
            "NetworkPolicy",
            "Deployment",
        ]


def test_the_charts_pod_monitor_scrapes_lanes_on_the_admin_port() -> None:
    values = {"metrics": {"serviceMonitor": {"enabled": True}}}
    docs = documents(template(find_helm(), values).stdout)
    monitors = by_kind(docs, "PodMonitor")
    [monitor] = [d for d in monitors if d["metadata"]["name"].endswith("-embedlanes")]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [container] = pod_of()["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert endpoint["port"] == "admin" and named["admin"] == engine_objects.ADMIN_PORT
    assert endpoint["path"] == "/metrics"
