"""`continuum engine`'s runtime in a test: the fake llama-server it launches, and the runtime
run over a gateway with its published runtime documents kept."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.runtime import EngineRuntime, LaunchSettings
from tests.support import fake_llama


def fake_server(tmp_path: Path) -> str:
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake_llama.__file__}" "$@"\n')
    script.chmod(0o755)
    return str(script)


def run_runtime(
    launch: LaunchSettings,
    body: Callable[[EngineRuntime, list[dict[str, Any]]], Awaitable[None]],
) -> None:
    """`body` with the runtime of `launch` running (before a gateway with no upstream yet) and
    the runtime documents it has published so far; the runtime stopped after."""
    published: list[dict[str, Any]] = []

    async def publish(doc: dict[str, Any]) -> None:
        published.append(doc)

    async def go() -> None:
        gateway = Gateway(GatewaySettings(upstream="http://127.0.0.1:1", health_seconds=0.1))
        await gateway.start()
        runtime = EngineRuntime(launch, gateway, publish=publish, echo_log=False)
        running = asyncio.create_task(runtime.run())
        try:
            await body(runtime, published)
        finally:
            await runtime.stop()
            await asyncio.wait_for(running, 20)
            await gateway.close()

    asyncio.run(go())
