"""The operator logs in with a kubeconfig when one is named and as its pod's ServiceAccount
in a cluster, where the chart runs it with no kubeconfig at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum_operator.kube.client.api import KubeApi


def test_in_a_pod_without_a_kubeconfig_the_service_account_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("the-token")
    (sa / "ca.crt").write_text("not a real certificate")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(
        "kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME", str(sa / "token")
    )
    monkeypatch.setattr(
        "kubernetes.config.incluster_config.SERVICE_CERT_FILENAME", str(sa / "ca.crt")
    )
    api = KubeApi(None)
    configuration = api._client.configuration
    assert configuration.host == "https://10.0.0.1:443"
    assert "the-token" in " ".join(configuration.api_key.values())


def test_outside_a_pod_a_missing_kubeconfig_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(Exception, match="kube-config"):
        KubeApi(str(tmp_path / "missing"))
