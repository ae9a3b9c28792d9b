"""Fixtures for end-to-end tests against the real llama.cpp (loaded as a pytest plugin).

- `tiny_model` (session): a generated random-weight 4-layer llama GGUF (f16) in pytest's tmp.
- `llama_server_bin` (session): the `llama-server` built by `tools/llama build` (`make toolchain`);
  fails with that instruction when it is missing.
- `llama_server` (function): `llama-server` serving `tiny_model` on a free loopback port with
  `-c 1024 --parallel 2 --slots`; yields the base URL once `/health` answers, and stops the
  server afterwards. When the test fails, the tail of the server's log is attached to its report.
- `llama_log` (function): captures llama.cpp's own log lines (through `llama_cpp.llama_log_set`)
  while the test runs; needs the llama-cpp-python wheel (`tools/llama install PYTHON`).

What tests use beside the fixtures is in tests/support/llama_server.py (`start_llama_server()`
starts a server on any model and arguments, for tests that need another) and
tests/support/local_http.py (`http_json`, through the standard library only).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.testing import write_tiny_gguf
from tests.support.llama_server import (
    TINY_SHAPE,
    LlamaLog,
    TinyModel,
    find_llama_server,
    import_llama_cpp,
    start_llama_server,
    tail,
)

# What `from tests.e2e.llama_fixtures import *` (tests/e2e/conftest.py) brings in: the fixtures.
__all__ = ["llama_log", "llama_server", "llama_server_bin", "tiny_model"]

_server_logs = pytest.StashKey[list[Path]]()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("models") / "tiny-l4-e128.gguf"
    write_tiny_gguf(path, TINY_SHAPE, seed=0)
    return TinyModel(path=path, shape=TINY_SHAPE)


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
                report.sections.append((f"llama-server log tail ({log})", tail(log)))


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
