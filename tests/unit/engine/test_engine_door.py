"""The engine's door in a cluster: every engine reviews minds' tokens, may do so, and is
reachable only from its allowed namespaces (docs/gateway.md, "Who is asking").

The finding this guards: as shipped, the operator never turned token review on, so a client with
no token could name another mind and spend her grant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from continuum_operator.cli import build_parser, main
from continuum_operator.cli.engine import settings_from
from continuum_operator.door.token_review import TokenReviewer
from continuum_operator.engine.admission import ReviewUnavailable
from continuum_operator.engine.runtime import _reviewer
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.client.api import path_of
from continuum_operator.kube.workloads import engine_identity, engine_objects
from tests.support import builders


def engine(**spec: Any) -> Any:
    return builders.engine(builders.engine_body(**spec))


def engine_args(*extra: str) -> Any:
    return build_parser().parse_args(["engine", "--model", "m.gguf", *extra])


class TestEveryEngineReviewsTokens:
    def test_the_operator_runs_each_engine_with_review_and_an_admin_port(self) -> None:
        plan = builders.plan_on_a_gpu(engine_args=("-c", "1024"))
        cmd = engine_objects.command(engine(), plan, PodSettings())
        flags = cmd[: cmd.index("--")]
        assert "--review-tokens" in flags and "--unsafe-trust-mind-header" not in flags
        assert flags[flags.index("--admin-port") + 1] == str(engine_objects.ADMIN_PORT)

    def test_an_engine_of_the_cluster_reviews_with_its_own_audience_by_default(self) -> None:
        reviewer = _reviewer(settings_from(engine_args("--engine", "ml/coder")), None)
        assert isinstance(reviewer, TokenReviewer)
        assert reviewer.audience == "continuum.dev/engine/ml/coder"

    def test_only_the_unsafe_flag_believes_the_header(self) -> None:
        unsafe = engine_args("--engine", "ml/coder", "--unsafe-trust-mind-header")
        assert _reviewer(settings_from(unsafe), None) is None

    def test_a_review_the_api_server_never_answers_is_bounded_and_unavailable(self) -> None:
        import asyncio

        class SilentApi:
            """An API server that accepts the connection and never answers: the client's
            request timeout is all that ends the call."""

            def __init__(self) -> None:
                self.timeouts: list[Any] = []

            async def create(self, review: Any, *, seconds: float | None = None) -> Any:
                self.timeouts.append(seconds)
                if seconds is None:
                    raise AssertionError("a review without a timeout would hang her request")
                raise TimeoutError("read timed out")

        api = SilentApi()
        reviewer = TokenReviewer("continuum.dev/engine/ml/coder", api=api)
        with pytest.raises(ReviewUnavailable):  # a 503 to send again, not held, not a 401
            asyncio.run(reviewer("tok"))
        assert api.timeouts and all(t is not None for t in api.timeouts)
        with pytest.raises(ReviewUnavailable):
            asyncio.run(reviewer("tok"))
        assert len(api.timeouts) == 2  # not kept: the next request asks again

    def test_a_grant_file_without_an_audience_or_the_unsafe_flag_is_refused(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        assert main(["engine", "--model", str(model), "--grants", "g.yaml"]) == 2
        assert "--unsafe-trust-mind-header" in capsys.readouterr().err


class TestTheEnginesIdentityMayReviewTokens:
    def test_its_service_account_is_bound_to_the_auth_delegator_role(self) -> None:
        e = engine()
        *_, binding = engine_identity.engine_rbac(e, "u")
        assert binding["kind"] == "ClusterRoleBinding"
        assert binding["roleRef"]["name"] == "system:auth-delegator"
        [subject] = binding["subjects"]
        assert (subject["name"], subject["namespace"]) == (
            engine_objects.service_account_name(e),
            "ns",
        )
        assert "ownerReferences" not in binding["metadata"]  # cluster-scoped: no namespaced owner
        assert path_of(binding) == (
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/"
            "continuum-engine-tokenreview%3Ans%3Aeng"
        )

    def test_two_engines_never_share_a_binding(self) -> None:
        a = builders.engine(
            {**builders.engine_body(), "metadata": {"name": "b-c", "namespace": "a"}}
        )
        b = builders.engine(
            {**builders.engine_body(), "metadata": {"name": "c", "namespace": "a-b"}}
        )
        assert engine_identity.token_review_binding_name(
            a
        ) != engine_identity.token_review_binding_name(b)


class TestTheNetworkPolicy:
    def test_it_admits_its_own_and_its_allowed_namespaces_on_the_gateway_port_only(self) -> None:
        policy = engine_identity.network_policy(
            engine(allowedNamespaces=["team-b"]), "u", PodSettings()
        )
        assert path_of(policy) == "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/eng"
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"] == engine_objects.selector(engine())
        minds, admin = spec["ingress"]
        [expr] = minds["from"][0]["namespaceSelector"]["matchExpressions"]
        assert (expr["key"], expr["operator"], expr["values"]) == (
            "kubernetes.io/metadata.name",
            "In",
            ["ns", "team-b"],
        )
        assert minds["ports"] == [{"protocol": "TCP", "port": PodSettings().port}]
        # The admin port (metrics, releases, runtime) is for labelled namespaces, not minds'.
        assert admin["ports"] == [{"protocol": "TCP", "port": engine_objects.ADMIN_PORT}]
        assert admin["from"] == [
            {"namespaceSelector": {"matchLabels": {engine_objects.SCRAPE_LABEL: "true"}}}
        ]

    def test_an_engine_open_to_every_namespace_admits_every_namespace(self) -> None:
        policy = engine_identity.network_policy(engine(allowedNamespaces=["*"]), "u", PodSettings())
        assert policy["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {}}]
