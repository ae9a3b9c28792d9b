"""The Mind's pod of the demo and the real node's tests (`testing.mind_pod`)."""

from __future__ import annotations

from continuum_operator.engine.admission import engine_audience
from continuum_operator.testing.mind_pod import mind_pod

REAL = {"continuum.dev/real-node": "true"}


def pod(**extra: object) -> dict[str, object]:
    return mind_pod(
        name="rae-turn-1", namespace="minds", service_account_name="rae",
        engine_namespace="minds", engine_name="tiny", endpoint="http://tiny.minds.svc:8080",
        image="img", prompt="Hello", max_tokens=8, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_turn_pod_kept_off_fake_nodes_runs_where_its_selector_says() -> None:
    # A KWOK node takes any pod and shows it Running forever: a turn scheduled there never
    # ends, so the demo and the real node's tests pin their turns to the real node.
    spec = pod(node_selector=REAL)["spec"]
    assert isinstance(spec, dict) and spec["nodeSelector"] == REAL
    assert "nodeSelector" not in pod()["spec"]  # type: ignore[operator]


def test_her_token_is_projected_for_the_engines_audience_and_nothing_else_is_mounted() -> None:
    spec = pod()["spec"]
    assert isinstance(spec, dict)
    assert spec["serviceAccountName"] == "rae" and spec["automountServiceAccountToken"] is False
    (volume,) = spec["volumes"]
    token = volume["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == engine_audience("minds", "tiny")
    assert spec["restartPolicy"] == "Never"
