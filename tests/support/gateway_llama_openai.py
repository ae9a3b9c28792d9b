"""The gateway and the engine runtime in front of the real llama-server, on a generated model
of 8k context in two slots, for the official clients (openai, anthropic): the rig (`run_engine`,
`Engine.agent`) and the grant table it serves (`granted`, `table`). Its stand-in counterpart, on
the fake llama-server, is tests/support/gateway.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from continuum_operator.door.serving import serve_app
from continuum_operator.door.token_review import Caller
from continuum_operator.engine.admission import GrantTable, ServiceAccount, TableEntry
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.runtime import EngineRuntime, LaunchSettings
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.model.mind import GrantState
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from tests.support.llama_server import TinyModel

MIRA, ANN, VIP = "minds/mira", "minds/ann", "minds/vip"
CTX = 8192
SLOT_TOKENS = CTX // 2
SHAPE = TinyModelShape(context_length=CTX)
# Never stop at an end-of-sequence token: a generation runs as long as it is allowed.
ENDLESS = {"ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("models") / "tiny-8k.gguf"
    write_tiny_gguf(path, SHAPE, seed=0)
    return TinyModel(path=path, shape=SHAPE)


def granted(mind: str = MIRA, slot: int = 1, tokens: int = SLOT_TOKENS) -> TableEntry:
    return TableEntry(mind, GrantState.GRANTED, "SlotFree", slot=slot, tokens=tokens, since="g")


def table(*entries: TableEntry) -> GrantTable:
    return GrantTable(SLOT_TOKENS, entries={e.mind: e for e in entries})


@dataclass
class Engine:
    gateway: Gateway
    http: aiohttp.ClientSession
    url: str
    clients: list[openai.AsyncOpenAI]

    def agent(self, mind: str = MIRA) -> openai.AsyncOpenAI:
        """An agent as written for OpenAI: only the base URL is the engine's."""
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused-here",  # no review in this test: the header names her
            default_headers={MIND_HEADER: mind},
            max_retries=0,
        )
        self.clients.append(client)
        return client

    async def slots(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.gateway.settings.upstream}/slots") as resp:
            data: list[dict[str, Any]] = await resp.json()
            return data


def run_engine(
    llama_server_bin: Path,
    model: TinyModel,
    initial: GrantTable,
    body: Callable[[Engine], Awaitable[None]],
    args: Sequence[str] = ("-c", str(CTX), "--parallel", "2", "-t", "2"),
    review_token: Callable[[str, Caller], Awaitable[ServiceAccount | None]] | None = None,
) -> None:
    launch = LaunchSettings(
        llama_server=str(llama_server_bin), model=model.path, args=tuple(args), port=0
    )

    async def main() -> None:
        gateway = Gateway(
            GatewaySettings(
                upstream="http://127.0.0.1:1", health_seconds=0.2, review_token=review_token
            )
        )
        await gateway.start()
        runtime = EngineRuntime(launch, gateway, echo_log=False)
        running = asyncio.create_task(runtime.run())
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        clients: list[openai.AsyncOpenAI] = []
        try:
            deadline = time.monotonic() + 120
            while runtime.phase != "Serving" or gateway.slot_count is None:
                assert time.monotonic() < deadline, "\n".join(runtime.load_log[-40:])
                await asyncio.sleep(0.1)
            gateway.set_table(initial)
            async with aiohttp.ClientSession() as http:
                await body(Engine(gateway, http, f"http://{address}", clients))
        finally:
            for client in clients:
                await client.close()
            await runner.cleanup()
            await runtime.stop()
            await asyncio.wait_for(running, 30)
            await gateway.close()

    asyncio.run(main())
