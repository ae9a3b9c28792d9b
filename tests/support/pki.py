"""A throwaway PKI for tests of TLS logins (`kube.client.login`): a CA, a server certificate for
127.0.0.1 and a client certificate, made with the `openssl` command, and an HTTPS server on this
machine that answers only clients showing a certificate of that CA."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Pki:
    directory: Path

    def file(self, name: str) -> Path:
        return self.directory / name

    def data(self, name: str) -> str:
        """The file's bytes in base64, as a kubeconfig's `...-data` fields hold them."""
        return base64.b64encode(self.file(name).read_bytes()).decode()


def make_pki(directory: Path) -> Pki:
    """ca.crt; server.crt/.key for 127.0.0.1; client.crt/.key (CN "tester"); all signed by the
    CA."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=continuum-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, usage, extra in (("server", "serverAuth", "subjectAltName=IP:127.0.0.1\n"),
                               ("client", "clientAuth", "")):  # fmt: skip
        (directory / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid\n{extra}"
        )
        cn = "127.0.0.1" if name == "server" else "tester"
        openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={cn}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt",
                "-extfile", f"{name}.ext")  # fmt: skip
    return Pki(directory)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        peer = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        pairs = [p for rdn in (peer or {}).get("subject", ()) for p in rdn]
        cn = next((p[1] for p in pairs if isinstance(p, tuple) and p[0] == "commonName"), None)
        said = {"kind": "Who", "cn": cn,
                "authorization": self.headers.get("Authorization")}  # fmt: skip
        body = json.dumps(said).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def https_server(pki: Pki, *, client_certificate: bool) -> Iterator[str]:
    """An HTTPS server on 127.0.0.1 with the PKI's server certificate, that answers each GET
    with the client certificate's CN and the Authorization header it got; with
    `client_certificate`, a client without one of the CA's is refused at the handshake. Yields
    its URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.file("server.crt"), pki.file("server.key"))
    context.load_verify_locations(pki.file("ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED if client_certificate else ssl.CERT_NONE
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
