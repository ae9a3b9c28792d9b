"""The gateway and the engine runtime (`EngineRuntime`, llama-server started and watched, its load
turned into a receipt) in front of the real llama-server, on a generated model of 16k context in
two slots, for the tests of the native endpoints (turns, completions): the rig (`run_engine`,
`Engine`) and the grant table's entries (`granted`, `reclaiming`, `queued`, `table`). Its
stand-in counterpart, on the fake llama-server, is tests/support/gateway.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine.admission import GrantTable, TableEntry
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.runtime import EngineRuntime, LaunchSettings
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.gguf import file_sha256
from continuum_operator.model.mind import GrantState
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from tests.support.llama_server import TinyModel
from tests.support.local_http import free_port

MIRA, ANN, VIP = "minds/mira", "minds/ann", "minds/vip"
SLOTS = 2
CTX = 16384  # 8,192 tokens per slot: room for generations long enough to interrupt
SLOT_TOKENS = CTX // SLOTS
# llama-server caps a slot's context at the model's training context: train it for the slots.
SHAPE = TinyModelShape(context_length=CTX)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("models") / "tiny-16k.gguf"
    write_tiny_gguf(path, SHAPE, seed=0)
    return TinyModel(path=path, shape=SHAPE)


def granted(mind: str, slot: int, tokens: int = SLOT_TOKENS) -> TableEntry:
    return TableEntry(mind, GrantState.GRANTED, "SlotFree", slot=slot, tokens=tokens, since="g")


def reclaiming(mind: str, slot: int, grace: float = 10.0, reason: str = "Preempted") -> TableEntry:
    return TableEntry(
        mind,
        GrantState.RECLAIMING,
        reason,
        slot=slot,
        tokens=SLOT_TOKENS,
        by=VIP if reason == "Preempted" else None,
        deadline=time.time() + grace,
        since=f"r{time.time()}",
    )


def queued(mind: str, reason: str = "PoolFull") -> TableEntry:
    return TableEntry(mind, GrantState.QUEUED, reason)


def table(*entries: TableEntry, phase: EnginePhase = EnginePhase.SERVING) -> GrantTable:
    return GrantTable(SLOT_TOKENS, phase, {e.mind: e for e in entries})


@dataclass
class Engine:
    url: str
    upstream: Callable[[], str]
    gateway: Gateway
    runtime: EngineRuntime
    http: aiohttp.ClientSession

    async def open(self, mind: str) -> tuple[int, dict[str, Any]]:
        async with self.http.post(
            f"{self.url}/v1/turns", json={}, headers={MIND_HEADER: mind}
        ) as resp:
            return resp.status, await resp.json()

    async def complete(self, mind: str, turn_id: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(
            f"{self.url}/completion",
            json=body,
            headers={MIND_HEADER: mind, TURN_HEADER: turn_id},
        ) as resp:
            return resp.status, await resp.json()

    async def slots(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.upstream()}/slots") as resp:
            data: list[dict[str, Any]] = await resp.json()
            return data

    async def processing(self, slot: int) -> bool:
        return bool((await self.slots())[slot]["is_processing"])


def run_engine(
    llama_server_bin: Path,
    model: TinyModel,
    tmp_path: Path,
    initial: GrantTable,
    body: Callable[[Engine], Awaitable[None]],
    gateway_settings: dict[str, Any] | None = None,
    **launch_options: Any,
) -> dict[str, Any]:
    """Run the runtime and gateway around `body`; the last status.runtime published.
    `gateway_settings`: the gateway's, besides its upstream and health probe;
    `launch_options`: more of LaunchSettings (a park store, say)."""
    launch = LaunchSettings(
        llama_server=str(llama_server_bin),
        model=model.path,
        args=("-c", str(CTX), "--parallel", str(SLOTS), "-t", "2"),
        model_sha256=file_sha256(model.path),
        port=0,
        restart_backoff=(0.2,),
        **launch_options,
    )
    published: list[dict[str, Any]] = []
    log = (tmp_path / "llama-server.log").open("w")

    async def publish(doc: dict[str, Any]) -> None:
        published.append(doc)

    async def main() -> None:
        gateway = Gateway(
            GatewaySettings(
                upstream="http://127.0.0.1:1", health_seconds=0.2, **(gateway_settings or {})
            )
        )
        await gateway.start()
        runtime = EngineRuntime(launch, gateway, publish=publish, echo_log=False)
        running = asyncio.create_task(runtime.run())
        app_runner = web.AppRunner(gateway.app(), handler_cancellation=True)
        await app_runner.setup()
        port = free_port()
        await web.TCPSite(app_runner, "127.0.0.1", port).start()
        try:
            deadline = time.monotonic() + 120
            while runtime.phase != "Serving":
                assert time.monotonic() < deadline, "\n".join(runtime.load_log[-40:])
                await asyncio.sleep(0.1)
            gateway.set_table(initial)
            async with aiohttp.ClientSession() as http:
                await body(
                    Engine(
                        f"http://127.0.0.1:{port}",
                        lambda: gateway.settings.upstream,
                        gateway,
                        runtime,
                        http,
                    )
                )
        finally:
            log.write("\n".join(runtime.load_log))
            log.close()
            await app_runner.cleanup()
            await runtime.stop()
            await asyncio.wait_for(running, 30)
            await gateway.close()

    asyncio.run(main())
    return published[-1] if published else {}
