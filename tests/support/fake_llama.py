"""A stand-in for llama-server: the part of its HTTP API the gateway uses, with slot state.

`/health`, `/tokenize` (one token per word, plus one for BOS when `add_special`; a list
content counts each token id as one and each string by its words, as llama-server tokenizes
a mixed prompt in one call), `/apply-template` (a chatml-like template),
`/completion` (on the slot `id_slot` names; `n_predict` tokens, `token_seconds` apart; plain
or streamed as server-sent events), the OpenAI endpoints `/v1/chat/completions`,
`/v1/completions` (plain or streamed, ending with `data: [DONE]`), `/v1/messages` (as
llama-server runs it: on the first idle slot, whatever `id_slot` says), `/v1/embeddings` and
`/v1/models`, `GET /slots`, `POST /slots/{id}?action=erase|save|restore`, `GET /props` (with the
engine's own path), `/detokenize` and `/metrics`. `tokenize_seconds` and
`headers_seconds` (a stream's headers sent only after the prompt is read, as llama-server
does) make those waits long enough for a reclaim to land in them. Each slot
keeps the tokens in its cache (`n_past`), so a test can see whether a slot was erased, and
requests dropped by their client are recorded as cancelled, as llama-server drops them. The
real llama-server runs the same scenarios in tests/e2e/test_gateway_llama.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
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
    tokenize_seconds: float = 0.0
    headers_seconds: float = 0.0
    tokenize_calls: int = 0
    template_calls: int = 0
    #: `--slot-save-path` (None: save and restore refused, as llama-server does without it).
    save_path: str | None = None
    token_bytes: int = 100
    save_seconds: float = 0.0
    saved: list[tuple[int, str]] = field(default_factory=list)
    restored: list[tuple[int, str]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/completion", self.completion)
        app.router.add_post("/apply-template", self.apply_template)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.oai_completions)
        app.router.add_post("/v1/messages", self.anthropic_messages)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/slots", self.list_slots)
        app.router.add_get("/props", self.props)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/slots/{id}", self.slot_action)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_calls += 1
        await asyncio.sleep(self.tokenize_seconds)
        content = body["content"]
        pieces = content if isinstance(content, list) else [content]
        n = sum(1 if isinstance(p, int) else len(str(p).split()) for p in pieces)
        tokens = ([1] if body.get("add_special") else []) + [7] * n
        return web.json_response({"tokens": tokens})

    @staticmethod
    def template(body: dict[str, Any]) -> str:
        turns = [
            f"<|im_start|>{m['role']} {m.get('content') or ''}"
            + "".join(
                f" {c['function']['name']} {c['function']['arguments']}"
                for c in m.get("tool_calls") or []
            )
            + " <|im_end|>"
            for m in body["messages"]
        ]
        return " ".join([*turns, "<|im_start|>assistant"])

    async def apply_template(self, request: web.Request) -> web.Response:
        self.template_calls += 1
        return web.json_response({"prompt": self.template(await request.json())})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.5]}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._openai(request, body, 1 + len(self.template(body).split()), chat=True)

    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        """llama-server's own `/v1/messages`, as its conversion to a chat does it: only a few
        sampling fields are copied (an `id_slot` is dropped), and the task runs on the first
        idle slot, whoever's it is. (Answered in chat's shape: the tests read only the slot.)"""
        body = await request.json()
        chat = {k: body[k] for k in ("temperature", "top_p", "top_k", "stream") if k in body}
        chat["messages"] = [
            {"role": m["role"], "content": str(m["content"])} for m in body["messages"]
        ]
        chat["n_predict"] = body.get("max_tokens", -1)
        chat["id_slot"] = min(set(range(self.slots)) - self.busy)
        return await self._openai(request, chat, 1 + len(self.template(chat).split()), chat=True)

    async def oai_completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._openai(
            request, body, self._prompt_tokens(body.get("prompt")), chat=False
        )

    async def _openai(
        self, request: web.Request, body: dict[str, Any], prompt: int, *, chat: bool
    ) -> web.StreamResponse:
        """An OpenAI-shaped generation of `n_predict` (else `max_tokens`) tokens."""
        self.requests.append(body)
        slot = body["id_slot"]
        assert 0 <= slot < self.slots
        if prompt >= self.n_ctx:  # as llama-server refuses a prompt its slot cannot hold
            message = f"request ({prompt} tokens) exceeds the available context size"
            error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
            error |= {"n_prompt_tokens": prompt, "n_ctx": self.n_ctx}
            return web.json_response({"error": error}, status=400)
        n_predict = body.get("n_predict", body.get("max_tokens", -1))
        room = self.n_ctx - prompt
        limit = room if n_predict < 0 else min(n_predict, room)
        finish = "length" if limit in (n_predict, room) else "stop"
        self.n_past[slot] = prompt
        self.busy.add(slot)
        kind = "chat.completion" if chat else "text_completion"
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": limit,
            "total_tokens": prompt + limit,
        }

        def choice(text: str, reason: str | None, *, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": reason}
            key = "delta" if delta else "message"
            return {
                "index": 0,
                key: {"role": "assistant", "content": text},
                "finish_reason": reason,
            }

        try:
            if not body.get("stream"):
                for _ in range(limit):
                    await asyncio.sleep(self.token_seconds)
                    self.n_past[slot] += 1
                return web.json_response(
                    {
                        "id": "x",
                        "object": kind,
                        "created": 0,
                        "model": "tiny",
                        "choices": [choice(" tok" * limit, finish, delta=False)],
                        "usage": usage,
                    }
                )
            await asyncio.sleep(self.headers_seconds)  # the prompt is read before headers go
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            chunk_kind = kind + (".chunk" if chat else "")
            try:
                for i in range(limit):
                    await asyncio.sleep(self.token_seconds)
                    self.n_past[slot] += 1
                    last = i == limit - 1
                    event = {
                        "id": "x",
                        "object": chunk_kind,
                        "created": 0,
                        "model": "tiny",
                        "choices": [choice(" tok", finish if last else None, delta=True)],
                    }
                    if last:
                        event["usage"] = usage
                    await out.write(b"data: " + json.dumps(event, separators=(",", ":")).encode())
                    await out.write(b"\n\n")
                await out.write(b"data: [DONE]\n\n")
            except ConnectionError:
                self.cancelled.append(slot)
                return out
            await out.write_eof()
            return out
        except asyncio.CancelledError:
            self.cancelled.append(slot)
            raise
        finally:
            self.busy.discard(slot)

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "/srv/models/tiny.gguf",
                "total_slots": self.slots,
                "chat_template": "chatml",
                "bos_token": "<s>",
                "default_generation_settings": {
                    "n_ctx": self.n_ctx,
                    "params": {"temperature": 0.8},
                    "prompt": "another mind's words",
                },
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = (await request.json()).get("tokens", [])
        return web.json_response({"content": " ".join(f"t{t}" for t in tokens)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="llamacpp:prompt_tokens_total 1\n")

    async def list_slots(self, request: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "id": i,
                    "n_ctx": self.n_ctx,
                    "is_processing": i in self.busy,
                    "prompt": f"words held by slot {i}",
                }
                for i in range(self.slots)
            ]
        )

    async def slot_action(self, request: web.Request) -> web.Response:
        slot = int(request.match_info["id"])
        action = request.query.get("action")
        while slot in self.busy:  # llama-server defers a slot action until the slot is idle
            await asyncio.sleep(0.005)
        if action in ("save", "restore"):
            return await self._save_or_restore(slot, action, await request.json())
        assert action == "erase"
        n = self.n_past.pop(slot, 0)
        self.erased.append(slot)
        return web.json_response({"id_slot": slot, "n_erased": n})

    async def _save_or_restore(self, slot: int, action: str, body: dict[str, Any]) -> web.Response:
        """llama-server's slot save and restore: a file of `token_bytes` per token under
        `save_path` (`--slot-save-path`), written or read in `save_seconds`."""
        if self.save_path is None:
            error = {"code": 501, "message": "start it with `--slot-save-path`"}
            return web.json_response({"error": error}, status=501)
        path = Path(self.save_path) / body["filename"]
        await asyncio.sleep(self.save_seconds)
        if action == "save":
            n = self.n_past.get(slot, 0)
            path.write_bytes(f"{n}\n".encode().ljust(max(8, n * self.token_bytes), b"."))
            self.saved.append((slot, body["filename"]))
            ms = {"save_ms": self.save_seconds * 1000}
            return web.json_response(
                {"id_slot": slot, "filename": body["filename"], "n_saved": n,
                 "n_written": path.stat().st_size, "timings": ms}
            )  # fmt: skip
        if not path.is_file():
            error = {"code": 400, "message": "Unable to restore slot: no such file"}
            return web.json_response({"error": error}, status=400)
        data = path.read_bytes()
        self.n_past[slot] = int(data.split(b"\n", 1)[0])
        self.restored.append((slot, body["filename"]))
        return web.json_response(
            {"id_slot": slot, "filename": body["filename"], "n_restored": self.n_past[slot],
             "n_read": len(data), "timings": {"restore_ms": 0.1}}
        )  # fmt: skip

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
        await asyncio.sleep(self.headers_seconds)  # the prompt is read before headers go
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
    text = LOAD_LOG.format(
        ctx=args.ctx_size, parallel=args.parallel, host=args.host, port=args.port
    )
    # A model of many metadata keys: llama.cpp prints a line for each before the buffers.
    keys = int(os.environ.get("FAKE_LLAMA_METADATA_KEYS", "0"))
    build, _, rest = text.partition("\n")
    metadata = "".join(f"llama_model_loader: - kv {i:5}: key.{i} str = v\n" for i in range(keys))
    print(build + "\n" + metadata + rest)
    sys.stdout.flush()
    web.run_app(fake.app(), host=args.host, port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
