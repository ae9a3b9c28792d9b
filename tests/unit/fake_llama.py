"""A stand-in for llama-server: the part of its HTTP API the gateway uses, with slot state.

`/health`, `/tokenize` (one token per word, plus one for BOS when `add_special`),
`/completion` (on the slot `id_slot` names; `n_predict` tokens, `token_seconds` apart; plain
or streamed as server-sent events), `GET /slots` and `POST /slots/{id}?action=erase`. Each slot
keeps the tokens in its cache (`n_past`), so a test can see whether a slot was erased, and
requests dropped by their client are recorded as cancelled, as llama-server drops them. The
real llama-server runs the same scenarios in tests/e2e/test_gateway_llama.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeLlama:
    slots: int = 2
    n_ctx: int = 512
    token_seconds: float = 0.001
    healthy: bool = True
    n_past: dict[int, int] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    erased: list[int] = field(default_factory=list)
    busy: set[int] = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/completion", self.completion)
        app.router.add_get("/slots", self.list_slots)
        app.router.add_post("/slots/{id}", self.slot_action)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        words = str(body["content"]).split()
        tokens = ([1] if body.get("add_special") else []) + [7] * len(words)
        return web.json_response({"tokens": tokens})

    async def list_slots(self, request: web.Request) -> web.Response:
        return web.json_response(
            [
                {"id": i, "n_ctx": self.n_ctx, "is_processing": i in self.busy}
                for i in range(self.slots)
            ]
        )

    async def slot_action(self, request: web.Request) -> web.Response:
        slot = int(request.match_info["id"])
        assert request.query.get("action") == "erase"
        while slot in self.busy:  # llama-server defers an erase until the slot is idle
            await asyncio.sleep(0.005)
        n = self.n_past.pop(slot, 0)
        self.erased.append(slot)
        return web.json_response({"id_slot": slot, "n_erased": n})

    def _prompt_tokens(self, prompt: Any) -> int:
        if isinstance(prompt, list):
            return 1 + len(prompt)
        return 1 + len(str(prompt).split())

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        slot = body["id_slot"]
        assert 0 <= slot < self.slots
        n_predict = body.get("n_predict", -1)
        prompt = self._prompt_tokens(body.get("prompt"))
        room = self.n_ctx - prompt
        limit = room if n_predict < 0 else min(n_predict, room)
        self.n_past[slot] = prompt
        self.busy.add(slot)
        try:
            if body.get("stream"):
                return await self._stream(request, slot, prompt, limit)
            for _ in range(limit):
                await asyncio.sleep(self.token_seconds)
                self.n_past[slot] += 1
            return web.json_response(self._final(slot, prompt, limit))
        except asyncio.CancelledError:
            self.cancelled.append(slot)
            raise
        finally:
            self.busy.discard(slot)

    def _final(self, slot: int, prompt: int, predicted: int) -> dict[str, Any]:
        return {
            "content": " tok" * predicted,
            "id_slot": slot,
            "stop": True,
            "stop_type": "limit",
            "tokens_predicted": predicted,
            "tokens_evaluated": prompt,
        }

    async def _stream(
        self, request: web.Request, slot: int, prompt: int, limit: int
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for _ in range(limit):
                await asyncio.sleep(self.token_seconds)
                self.n_past[slot] += 1
                await out.write(
                    b"data: " + json.dumps({"content": " tok", "stop": False}).encode() + b"\n\n"
                )
            await out.write(
                b"data: " + json.dumps(self._final(slot, prompt, limit)).encode() + b"\n\n"
            )
        except ConnectionError:
            self.cancelled.append(slot)
            return out
        await out.write_eof()
        return out


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


# Run as a program, it stands in for the llama-server binary (tests of `engine.runtime`): it
# prints a load log as llama-server would, then serves the API above.
LOAD_LOG = """\
build: 6869 (1a2b3c4d) with cc (GCC) 13 for x86_64-linux-gnu
load_tensors: offloaded 0/5 layers to GPU
load_tensors:   CPU_Mapped model buffer size =     1.38 MiB
llama_context: n_seq_max             = {parallel}
llama_context: n_ctx                 = {ctx}
llama_context: flash_attn            = enabled
llama_context:        CPU  output buffer size =     0.00 MiB
llama_kv_cache:        CPU KV buffer size =     2.00 MiB
llama_kv_cache: size =    2.00 MiB (  {ctx} cells,   4 layers,  {parallel}/{parallel} seqs), \
K (f16):    1.00 MiB, V (f16):    1.00 MiB
sched_reserve:        CPU compute buffer size =     4.26 MiB
main: server is listening on http://{host}:{port} - starting the main loop"""


def main() -> None:
    import argparse
    import sys

    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("-np", "--parallel", type=int, default=1)
    args, _ = p.parse_known_args()
    fake = FakeLlama(slots=args.parallel, n_ctx=args.ctx_size // args.parallel)
    print(
        LOAD_LOG.format(ctx=args.ctx_size, parallel=args.parallel, host=args.host, port=args.port)
    )
    sys.stdout.flush()
    web.run_app(fake.app(), host=args.host, port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
