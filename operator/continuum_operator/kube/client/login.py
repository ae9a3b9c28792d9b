"""Where the API server is and how this process shows who it is (`Login`), read by our own
loader for the two cases we run in: a pod's ServiceAccount (its token and CA as the kubelet
mounts them) and a kubeconfig whose user has a token or a client certificate (what
`tools/cluster`, the tests and `kubectl create token` write). Both adapters
(`kube.client.api.KubeApi`, `kube.client.async_api.AsyncKubeApi`) log in through `login`.

Not the `kubernetes` package's loaders: importing that package cost each engine and lane
process about 14 MiB (docs/performance.md) for two small files' worth of reading. What a
kubeconfig may hold beyond these (an exec plugin, an auth provider, a username and password,
impersonation, several files merged) is refused with a `LoginError` that says what to do, never
skipped: a process that logged in as someone else than its kubeconfig says would be worse than
one that stops.

Blocking: it reads files (run it in a thread on the event loop, as `AsyncKubeApi.connect`
does). The ServiceAccount's token is read again at most once a minute (`BearerToken`), since
the kubelet rotates it.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from continuum_operator.model.json_body import items_at, object_at, text

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "BearerToken",
    "Login",
    "LoginError",
    "from_kubeconfig",
    "from_service_account",
    "in_cluster",
    "kubeconfig_path",
    "login",
]

#: Where the kubelet mounts a pod's ServiceAccount: `token`, `ca.crt`.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Seconds a token read from a file is used before the file is read again (client-go's period
#: for the ServiceAccount's token, which the kubelet rotates well before it expires).
TOKEN_REREAD_SECONDS = 60.0

#: A kubeconfig user's fields that name a way to log in this loader does not take, and what to
#: do instead.
_UNSUPPORTED_USER = {
    "exec": "an exec plugin",
    "auth-provider": "an auth provider",
    "username": "a username and password",
    "password": "a username and password",
    "as": "impersonation",
    "as-uid": "impersonation",
    "as-groups": "impersonation",
    "as-user-extra": "impersonation",
}
_INSTEAD = (
    "continuum logs in with a token or a client certificate only: give it a kubeconfig whose "
    "user has `token`, `tokenFile` or `client-certificate(-data)` and `client-key(-data)` (a "
    "ServiceAccount's token from `kubectl create token NAME -n NS` will do), or run it in a "
    "pod as its ServiceAccount"
)


class LoginError(ConnectionError):
    """No API server to log in to, or no way this loader can log in to it: what was wrong and
    what to do. An `OSError`, as an unreachable server is, so that a caller's `except OSError`
    holds for both."""


class BearerToken:
    """A bearer token: as given, or read from `path` (again once `reread_seconds` have passed
    since the last read, so that a token the kubelet rotated is picked up)."""

    def __init__(
        self,
        value: str = "",
        path: Path | None = None,
        *,
        reread_seconds: float = TOKEN_REREAD_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._value = value.strip()
        self._path = path
        self._reread = reread_seconds
        self._clock = clock
        self._read_at: float | None = None
        if path is not None:
            self._read()

    def _read(self) -> None:
        assert self._path is not None
        try:
            self._value = self._path.read_text().strip()
        except OSError as err:
            raise LoginError(f"cannot read the token file {self._path}: {err.strerror}") from err
        self._read_at = self._clock()

    def value(self) -> str:
        if self._read_at is not None and self._clock() - self._read_at >= self._reread:
            self._read()
        return self._value


@dataclass(frozen=True)
class Login:
    """Where the API server is (`server`: scheme, host and port, no trailing slash) and how to
    reach it: `tls` (None for a plain http:// server, as a local proxy is), the name TLS checks
    where it is not the server's host, a proxy, and the bearer token (None: a client
    certificate, in `tls`, or nothing)."""

    server: str
    tls: ssl.SSLContext | None = None
    tls_server_name: str | None = None
    proxy: str | None = None
    token: BearerToken | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        """The credentials each request carries, read as it goes (a token file is read again
        as it rotates)."""
        value = self.token.value() if self.token is not None else ""
        return {"Authorization": f"Bearer {value}"} if value else {}


def in_cluster(kubeconfig: str | None) -> bool:
    """Whether to log in as the pod's ServiceAccount: in a pod, with no kubeconfig named (the
    chart runs the operator so); else the kubeconfig (`--kubeconfig`, $KUBECONFIG, ~/.kube)."""
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return kubeconfig is None and not os.environ.get("KUBECONFIG") and in_pod


def login(kubeconfig: str | None) -> Login:
    """As the pod's ServiceAccount (`in_cluster`), else from the kubeconfig named, $KUBECONFIG
    or ~/.kube/config."""
    if in_cluster(kubeconfig):
        return from_service_account(os.environ, SERVICE_ACCOUNT_DIR)
    return from_kubeconfig(kubeconfig_path(kubeconfig))


def kubeconfig_path(kubeconfig: str | None) -> Path:
    """The one kubeconfig file to read: named, else $KUBECONFIG (one file), else
    ~/.kube/config."""
    if kubeconfig:
        return Path(kubeconfig).expanduser()
    named = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if len(named) > 1:
        raise LoginError(
            f"$KUBECONFIG names {len(named)} files and continuum reads one: name one with "
            "--kubeconfig or $KUBECONFIG (`kubectl config view --flatten --minify > FILE` "
            "writes the current context's as one)"
        )
    return Path(named[0] if named else "~/.kube/config").expanduser()


def from_service_account(
    env: Mapping[str, str],
    directory: Path = SERVICE_ACCOUNT_DIR,
    clock: Callable[[], float] = time.monotonic,
) -> Login:
    """The pod's ServiceAccount: the API server at $KUBERNETES_SERVICE_HOST and _PORT, its CA
    and token as mounted in `directory`."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise LoginError(
            "no API server to log in to: not in a pod ($KUBERNETES_SERVICE_HOST and _PORT "
            "unset); name a kubeconfig (--kubeconfig or $KUBECONFIG)"
        )
    token_file, ca_file = directory / "token", directory / "ca.crt"
    if not token_file.is_file():
        raise LoginError(
            f"in a pod, but its ServiceAccount's token is not mounted at {token_file}: "
            "run the pod with automountServiceAccountToken (the chart does), or name a "
            "kubeconfig (--kubeconfig or $KUBECONFIG)"
        )
    tls = _tls(ca_file=str(ca_file), where=f"the ServiceAccount's CA ({ca_file})")
    token = BearerToken(path=token_file, clock=clock)
    return Login(server=f"https://{_host(host)}:{port}", tls=tls, token=token)


def from_kubeconfig(path: Path) -> Login:
    """The current context's cluster and user, from the kubeconfig at `path` (a relative file
    it names is relative to the kubeconfig's own directory)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise LoginError(
            f"no API server to log in to: cannot read the kubeconfig {path} ({err.strerror}); "
            "name a kubeconfig (--kubeconfig or $KUBECONFIG) or run in a pod"
        ) from err
    except yaml.YAMLError as err:
        raise LoginError(f"the kubeconfig {path} is not YAML: {err}") from err
    where = f"the kubeconfig {path}"
    context_name = text(doc, "current-context")
    if not context_name:
        raise LoginError(f"{where} has no current-context: set one (kubectl config use-context)")
    context = _named(doc, "contexts", context_name, "context", where)
    cluster_name, user_name = text(context, "cluster"), text(context, "user")
    cluster = _named(doc, "clusters", cluster_name, "cluster", where)
    user = _named(doc, "users", user_name, "user", where) if user_name else {}
    refused = sorted({why for key, why in _UNSUPPORTED_USER.items() if key in user})
    if refused:
        raise LoginError(
            f"{where}: its user {user_name!r} logs in with {' and '.join(refused)}, which "
            f"continuum does not: {_INSTEAD}"
        )
    server = (text(cluster, "server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise LoginError(f"{where}: cluster {cluster_name!r} has no https:// server")
    proxy = text(cluster, "proxy-url") or None
    if proxy is not None and not proxy.startswith(("http://", "https://")):
        raise LoginError(
            f"{where}: cluster {cluster_name!r} has proxy-url {proxy!r}; continuum goes "
            "through an http:// or https:// proxy only: name one, or reach the server directly"
        )
    base = path.parent
    tls = None
    if server.startswith("https://"):
        with tempfile.TemporaryDirectory(prefix="continuum-login-") as directory:
            files = _CertFiles(directory)
            tls = _kubeconfig_tls(files, cluster, user, base, f"{where}, user {user_name!r}")
    return Login(
        server=server,
        tls=tls,
        tls_server_name=text(cluster, "tls-server-name") or None,
        proxy=proxy,
        token=_kubeconfig_token(user, base),
    )


def _named(
    doc: object, section: str, name: str | None, key: str, where: str
) -> Mapping[str, object]:
    for entry in items_at(doc, section):
        if isinstance(entry, Mapping) and entry.get("name") == name:
            return object_at(entry, key)
    raise LoginError(f"{where} has no {section[:-1]} named {name!r} (its current context's)")


def _kubeconfig_token(user: Mapping[str, object], base: Path) -> BearerToken | None:
    if text(user, "token"):
        return BearerToken(str(text(user, "token")))
    if text(user, "tokenFile"):
        return BearerToken(path=base / str(text(user, "tokenFile")))
    return None


def _kubeconfig_tls(
    files: _CertFiles,
    cluster: Mapping[str, object],
    user: Mapping[str, object],
    base: Path,
    where: str,
) -> ssl.SSLContext:
    ca = files.path_of(cluster, "certificate-authority", base, where)
    cert = files.path_of(user, "client-certificate", base, where)
    key = files.path_of(user, "client-key", base, where)
    if (cert is None) != (key is None):
        raise LoginError(f"{where}: a client certificate needs its key, and a key its certificate")
    return _tls(
        ca_file=ca,
        cert=(cert, key) if cert is not None and key is not None else None,
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        where=where,
    )


class _CertFiles:
    """The certificates a kubeconfig carries inline (`...-data`), written where `ssl` can load
    them (it loads a client certificate from files only): into a private directory the caller
    removes once the TLS context has loaded them."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path_of(
        self, section: Mapping[str, object], key: str, base: Path, where: str
    ) -> str | None:
        data = text(section, f"{key}-data")
        if data:
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as err:
                raise LoginError(f"{where}: {key}-data is not base64: {err}") from err
            path = Path(self.directory) / key
            path.write_bytes(raw)
            return str(path)
        named = text(section, key)
        return str(base / named) if named else None


def _tls(
    *,
    ca_file: str | None,
    cert: tuple[str, str] | None = None,
    insecure: bool = False,
    where: str,
) -> ssl.SSLContext:
    """The TLS a login asks for: its CA (else the system's), its client certificate, and no
    verification only where the kubeconfig says `insecure-skip-tls-verify`."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert is not None:
            context.load_cert_chain(*cert)
    except (OSError, ssl.SSLError) as err:
        raise LoginError(f"{where}: cannot load its certificates: {err}") from err
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _host(host: str) -> str:
    """An IPv6 address in brackets, as a URL holds it."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
