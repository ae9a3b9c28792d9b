"""How a process logs in to the API server (`kube.client.login`), without the `kubernetes`
package: as its pod's ServiceAccount in a cluster, where the chart runs it with no kubeconfig,
or from a kubeconfig with a token or a client certificate (inline or in files), each shown to a
real TLS server; what it cannot do (an exec plugin, an auth provider, several files) is refused
with what to do."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.kube.client.api import KubeApi
from continuum_operator.kube.client.login import (
    BearerToken,
    LoginError,
    from_kubeconfig,
    from_service_account,
    login,
)
from tests.support.pki import Pki, https_server, make_pki

LOGIN = "continuum_operator.kube.client.login"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def who(api: KubeApi) -> dict[str, Any]:
    return api.request("GET", "/whoami")


# --- in a pod -------------------------------------------------------------------------------


def service_account(tmp_path: Path, pki: Pki, token: str = "the-token") -> Path:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text(token + "\n")
    (sa / "ca.crt").write_bytes(pki.file("ca.crt").read_bytes())
    return sa


def test_in_a_pod_the_service_accounts_token_and_ca_are_used(tmp_path: Path, pki: Pki) -> None:
    sa = service_account(tmp_path, pki)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    got = from_service_account(env, sa)
    assert got.server == "https://10.0.0.1:443"
    assert got.headers() == {"Authorization": "Bearer the-token"}
    assert got.tls is not None and got.tls.verify_mode is ssl.CERT_REQUIRED
    ca = pki.file("ca.crt").read_text()
    assert ssl.DER_cert_to_PEM_cert(got.tls.get_ca_certs(binary_form=True)[0]) == ca


def test_in_a_pod_the_token_is_read_again_as_the_kubelet_rotates_it(
    tmp_path: Path, pki: Pki
) -> None:
    sa = service_account(tmp_path, pki, "first")
    now = [0.0]
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    got = from_service_account(env, sa, clock=lambda: now[0])
    (sa / "token").write_text("second")
    now[0] = 59.0
    assert got.headers()["Authorization"] == "Bearer first"  # read at most once a minute
    now[0] = 60.0
    assert got.headers()["Authorization"] == "Bearer second"


def test_an_ipv6_service_host_is_put_in_brackets(tmp_path: Path, pki: Pki) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert (
        from_service_account(env, service_account(tmp_path, pki)).server == "https://[fd00::1]:443"
    )


def test_in_a_pod_without_a_kubeconfig_login_takes_the_service_account(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(
        "continuum_operator.kube.client.login.SERVICE_ACCOUNT_DIR", tmp_path / "none"
    )
    with pytest.raises(LoginError, match=rf"{tmp_path}/none/token.*automountServiceAccountToken"):
        login(None)
    sa = service_account(tmp_path, pki)
    monkeypatch.setattr(f"{LOGIN}.SERVICE_ACCOUNT_DIR", sa)
    assert login(None).headers() == {"Authorization": "Bearer the-token"}


def test_outside_a_pod_without_a_kubeconfig_says_to_name_one(tmp_path: Path) -> None:
    with pytest.raises(LoginError, match=r"not in a pod.*--kubeconfig"):
        from_service_account({}, tmp_path)


# --- a kubeconfig, shown to a TLS server ----------------------------------------------------


def test_a_client_certificate_inline_is_shown_and_its_key_not_left_on_disk(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    with https_server(pki, client_certificate=True) as url:
        path = write_kubeconfig(
            tmp_path / "kubeconfig",
            {"server": url, "certificate-authority-data": pki.data("ca.crt")},
            {"client-certificate-data": pki.data("client.crt"),
             "client-key-data": pki.data("client.key")},
        )  # fmt: skip
        assert who(KubeApi(path)) == {"kind": "Who", "cn": "tester", "authorization": None}
    assert list((tmp_path / "tmp").iterdir()) == []  # the key written to load it, then removed


def test_a_client_certificate_in_files_relative_to_the_kubeconfig_is_shown(
    tmp_path: Path, pki: Pki
) -> None:
    with https_server(pki, client_certificate=True) as url:
        path = write_kubeconfig(
            pki.directory / "kubeconfig",
            {"server": url, "certificate-authority": "ca.crt"},
            {"client-certificate": "client.crt", "client-key": str(pki.file("client.key"))},
        )
        assert who(KubeApi(path))["cn"] == "tester"


def test_a_token_is_sent_over_tls_checked_against_the_ca(tmp_path: Path, pki: Pki) -> None:
    with https_server(pki, client_certificate=False) as url:
        path = write_kubeconfig(
            tmp_path / "kubeconfig",
            {"server": url, "certificate-authority": str(pki.file("ca.crt"))},
            {"token": "abc"},
        )
        assert who(KubeApi(path)) == {"kind": "Who", "cn": None, "authorization": "Bearer abc"}
        # Without the CA, the server's certificate is not trusted: the login is not weakened.
        path = write_kubeconfig(tmp_path / "no-ca", {"server": url}, {"token": "abc"})
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            who(KubeApi(path))


def test_a_token_file_is_read_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    path = write_kubeconfig(
        tmp_path / "kubeconfig", {"server": "http://127.0.0.1:1"}, {"tokenFile": "token"}
    )
    got = from_kubeconfig(Path(path))
    assert got.tls is None and got.headers() == {"Authorization": "Bearer from-file"}


def test_insecure_skip_tls_verify_is_honoured_only_where_the_kubeconfig_says_so(
    tmp_path: Path,
) -> None:
    cluster = {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}
    got = from_kubeconfig(Path(write_kubeconfig(tmp_path / "k", cluster, {})))
    assert got.tls is not None and got.tls.verify_mode is ssl.CERT_NONE
    assert got.headers() == {}


# --- what it does not do, and says so -------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "said"),
    [
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "aws"}},
         "an exec plugin"),
        ({"auth-provider": {"name": "oidc"}}, "an auth provider"),
        ({"username": "admin", "password": "secret"}, "a username and password"),
        ({"token": "t", "as": "someone-else"}, "impersonation"),
    ],
)  # fmt: skip
def test_a_way_to_log_in_it_does_not_take_is_refused_with_what_to_do(
    tmp_path: Path, user: dict[str, Any], said: str
) -> None:
    path = write_kubeconfig(tmp_path / "k", {"server": "https://127.0.0.1:1"}, user)
    with pytest.raises(LoginError) as raised:
        login(path)
    message = str(raised.value)
    assert f"logs in with {said}" in message and "'u'" in message
    assert "kubectl create token" in message and "run it in a pod" in message


def test_a_missing_kubeconfig_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(OSError, match=f"cannot read the kubeconfig {tmp_path}/missing"):
        KubeApi(str(tmp_path / "missing"))


def test_several_kubeconfig_files_are_refused_with_how_to_make_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/a:/b")
    with pytest.raises(LoginError, match=r"names 2 files.*--flatten"):
        login(None)


def test_a_context_that_names_no_known_user_is_named(tmp_path: Path) -> None:
    doc = {"clusters": [{"name": "c", "cluster": {"server": "https://h:1"}}],
           "contexts": [{"name": "x", "context": {"cluster": "c", "user": "gone"}}],
           "current-context": "x"}  # fmt: skip
    (tmp_path / "k").write_text(json.dumps(doc))
    with pytest.raises(LoginError, match="has no user named 'gone'"):
        from_kubeconfig(tmp_path / "k")


def test_inline_data_that_is_not_base64_is_named(tmp_path: Path) -> None:
    cluster = {"server": "https://h:1", "certificate-authority-data": "not base64!"}
    with pytest.raises(LoginError, match="certificate-authority-data is not base64"):
        from_kubeconfig(Path(write_kubeconfig(tmp_path / "k", cluster, {})))


def test_a_proxy_other_than_http_is_refused_and_an_http_one_is_taken(tmp_path: Path) -> None:
    cluster = {"server": "https://h:1", "proxy-url": "socks5://127.0.0.1:1080"}
    with pytest.raises(LoginError, match="http:// or https:// proxy only"):
        from_kubeconfig(Path(write_kubeconfig(tmp_path / "k", cluster, {})))
    cluster["proxy-url"] = "http://127.0.0.1:3128"
    assert from_kubeconfig(Path(write_kubeconfig(tmp_path / "k", cluster, {}))).proxy == (
        "http://127.0.0.1:3128"
    )


def test_a_token_given_inline_is_not_read_again() -> None:
    token = BearerToken(" abc \n")
    assert token.value() == "abc"


def test_the_engine_and_lane_processes_import_no_kubernetes_package() -> None:
    # What `continuum engine` and `continuum embed` import: the command table (every
    # subcommand's arguments), their runtimes and the client. The package cost each about 14 MiB.
    code = (
        "import sys\n"
        "import continuum_operator.cli.command, continuum_operator.kube.client.async_api\n"
        "import continuum_operator.engine.runtime, continuum_operator.embed.runtime\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
