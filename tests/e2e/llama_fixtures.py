"""Fixtures for end-to-end tests against the real llama.cpp (loaded as a pytest plugin).

- `tiny_model` (session): a generated random-weight 4-layer llama GGUF (f16) in pytest's tmp.
- `llama_server_bin` (session): the `llama-server` built by `tools/llama build` (`make toolchain`);
  fails with that instruction when it is missing.
- `llama_server` (function): `llama-server` serving `tiny_model` on a free loopback port with
  `-c 1024 --parallel 2 --slots`; yields the base URL once `/health` answers, and stops the
  server afterwards. When the test fails, the tail of the server's log is attached to its report.
- `llama_log` (function): captures llama.cpp's own log lines (through `llama_cpp.llama_log_set`)
  while the test runs; needs the llama-cpp-python wheel (`tools/llama install PYTHON`).

`start_llama_server()` starts a server on any model and arguments, for tests that need another.
HTTP goes through the standard library only (`http_json`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.testing import TinyModelShape, write_tiny_gguf

# What `from tests.e2e.llama_fixtures import *` (tests/e2e/conftest.py) brings in: the fixtures.
__all__ = ["llama_log", "llama_server", "llama_server_bin", "tiny_model"]

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SCRIPT = ROOT / "tools" / "llama"
SERVER_LOG_TAIL = 60

#: The generated model the shared fixtures serve: 4 layers, n_embd 128, 4 heads, 2 KV heads.
TINY_SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, vocab_size=512)

_server_logs = pytest.StashKey[list[Path]]()


@dataclass(frozen=True)
class TinyModel:
    path: Path
    shape: TinyModelShape


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("models") / "tiny-l4-e128.gguf"
    write_tiny_gguf(path, TINY_SHAPE, seed=0)
    return TinyModel(path=path, shape=TINY_SHAPE)


def find_llama_server() -> Path | None:
    """The cached llama-server of the pinned version (via `tools/llama path`), if built."""
    proc = subprocess.run(
        [str(LLAMA_SCRIPT), "path"], capture_output=True, text=True, check=False, timeout=30
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    path = Path(proc.stdout.strip())
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    path = find_llama_server()
    if path is None:
        pytest.fail(
            "llama-server is not built: run `make toolchain` (or `tools/llama build`) first; "
            "it is cached under ${CONTINUUM_CACHE:-~/.cache/continuum}/bin",
            pytrace=False,
        )
    return path


# --- HTTP ------------------------------------------------------------------------------------


def http_json(
    url: str, body: dict[str, Any] | None = None, *, timeout: float = 30.0
) -> tuple[int, Any]:
    """GET (or POST `body` as JSON) and return (status, decoded JSON or text); never raises on
    an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            status, raw = err.code, err.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


# --- llama-server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, lines: int = SERVER_LOG_TAIL) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(no log: {err})"


class LlamaServerError(RuntimeError):
    pass


@dataclass
class LlamaServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = SERVER_LOG_TAIL) -> str:
        return _tail(self.log, lines)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaServerError(
                f"llama-server exited with {proc.returncode} before /health answered\n"
                f"--- log tail ({log}) ---\n{_tail(log)}"
            )
        try:
            status, body = http_json(f"{url}/health", timeout=2.0)
            if status == 200:
                return
            last = f"{status} {body}"
        except (OSError, urllib.error.URLError) as err:
            last = str(err)
        time.sleep(0.1)
    raise LlamaServerError(
        f"llama-server /health not ok after {timeout:.0f}s (last: {last})\n"
        f"--- log tail ({log}) ---\n{_tail(log)}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def start_llama_server(
    binary: Path,
    model: Path,
    log: Path,
    args: Sequence[str] = ("-c", "1024", "--parallel", "2", "--slots"),
    *,
    startup_timeout: float = 60.0,
    attempts: int = 3,
) -> Iterator[LlamaServer]:
    """Run llama-server on `model` on a free loopback port until the block ends.

    A port taken between choosing and binding it makes the server exit; that is retried.
    """
    for attempt in range(1, attempts + 1):
        port = free_port()
        argv = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            *args,
        ]
        url = f"http://127.0.0.1:{port}"
        with log.open("ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            try:
                _wait_healthy(proc, url, log, startup_timeout)
            except LlamaServerError:
                _stop(proc)
                if attempt < attempts and "bind" in _tail(log, 20).lower():
                    continue
                raise
            yield LlamaServer(url=url, process=proc, log=log, argv=argv)
            return
        finally:
            _stop(proc)
    raise AssertionError("unreachable")  # pragma: no cover


class _ServerLogReporter:
    """Attaches the tail of a failed test's llama-server logs to its report.

    A plugin object registered on first use (not a module-level hook), so that importing these
    fixtures into a conftest leaves that conftest's own hooks alone.
    """

    NAME = "continuum-llama-server-logs"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.failed:
            for log in item.stash.get(_server_logs, []):
                report.sections.append((f"llama-server log tail ({log})", _tail(log)))


def track_server_log(request: pytest.FixtureRequest, log: Path) -> None:
    """Attach `log`'s tail to the requesting test's report if it fails."""
    manager = request.config.pluginmanager
    if manager.get_plugin(_ServerLogReporter.NAME) is None:
        manager.register(_ServerLogReporter(), _ServerLogReporter.NAME)
    request.node.stash.setdefault(_server_logs, []).append(log)


@pytest.fixture
def llama_server(
    request: pytest.FixtureRequest,
    llama_server_bin: Path,
    tiny_model: TinyModel,
    tmp_path: Path,
) -> Generator[str, None, None]:
    log = tmp_path / "llama-server.log"
    track_server_log(request, log)
    with start_llama_server(llama_server_bin, tiny_model.path, log) as server:
        yield server.url


# --- llama.cpp's log, through llama-cpp-python -----------------------------------------------


@dataclass
class LlamaLog:
    """llama.cpp's log as one text (fragments joined; level 5 continues the previous line)."""

    chunks: list[tuple[int, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    def clear(self) -> None:
        self.chunks.clear()

    def mib(self, pattern: str) -> list[float]:
        """Every `<pattern> = X MiB` value, in order (pattern is a regex)."""
        return [float(m) for m in re.findall(pattern + r"\s*=\s*([0-9.]+) MiB", self.text)]


def import_llama_cpp() -> Any:
    """llama_cpp, or a clear failure saying how to install it."""
    try:
        import llama_cpp
    except ImportError as err:
        missing = str(err)
    else:
        return llama_cpp
    pytest.fail(
        f"llama-cpp-python is not installed ({missing}): run `make install` "
        "(or `tools/llama install .venv/bin/python`)",
        pytrace=False,
    )


@pytest.fixture
def llama_log() -> Generator[LlamaLog, None, None]:
    llama_cpp = import_llama_cpp()
    captured = LlamaLog()

    def on_log(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
        if text:
            captured.chunks.append((level, text.decode("utf-8", "replace")))

    callback: Callable[..., None] = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield captured
    finally:
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
