"""The real llama.cpp for the e2e tests: the generated model they serve (`TinyModel`), the cached
`llama-server` (`find_llama_server`) and a server of it on any model and arguments
(`start_llama_server`), the tail of its log, and llama.cpp's own log read through
llama-cpp-python (`LlamaLog`, `import_llama_cpp`). The fixtures built on these are in
tests/e2e/llama_fixtures.py."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.testing import TinyModelShape
from tests.support.builders import ROOT
from tests.support.local_http import free_port, http_json

LLAMA_SCRIPT = ROOT / "tools" / "llama"
SERVER_LOG_TAIL = 60

#: The generated model the shared fixtures serve: 4 layers, n_embd 128, 4 heads, 2 KV heads.
TINY_SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, vocab_size=512)


@dataclass(frozen=True)
class TinyModel:
    path: Path
    shape: TinyModelShape


def find_llama_server() -> Path | None:
    """The cached llama-server of the pinned version (via `tools/llama path`), if built."""
    proc = subprocess.run(
        [str(LLAMA_SCRIPT), "path"], capture_output=True, text=True, check=False, timeout=30
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    path = Path(proc.stdout.strip())
    return path if os.access(path, os.X_OK) else None


def tail(path: Path, lines: int = SERVER_LOG_TAIL) -> str:
    """The last `lines` of a log, or why there is none."""
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
        return tail(self.log, lines)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaServerError(
                f"llama-server exited with {proc.returncode} before /health answered\n"
                f"--- log tail ({log}) ---\n{tail(log)}"
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
        f"--- log tail ({log}) ---\n{tail(log)}"
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
                if attempt < attempts and "bind" in tail(log, 20).lower():
                    continue
                raise
            yield LlamaServer(url=url, process=proc, log=log, argv=argv)
            return
        finally:
            _stop(proc)
    raise AssertionError("unreachable")  # pragma: no cover


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
