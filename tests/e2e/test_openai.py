"""The official `openai` client against the real llama-server behind the gateway, on a
generated model (it has no chat template of its own: llama-server falls back to chatml).

An unmodified agent: no turn opened, the grant enforced all the same. Chat, a streamed chat,
completions and embeddings run on her slot; a prompt over her grant and `n: 2` are refused in
OpenAI's error shape; a reclaim during a stream ends it with an error event within the grace,
and the slot's release is reported. Her projected token, reviewed by the real API server, is
her key (200); one without the engine's audience is 401, another account's 403 (the turn
protocol's cases with tokens are in tests/e2e/test_gateway_kube.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from continuum_operator.engine.admission import (
    TableEntry,
    engine_audience,
)
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.model.mind import GrantState
from tests.support.cluster import Cluster
from tests.support.gateway_llama_openai import (
    ENDLESS,
    SLOT_TOKENS,
    Engine,
    granted,
    model,
    run_engine,
    table,
)
from tests.support.llama_server import TinyModel

pytestmark = pytest.mark.e2e

__all__ = ["model"]  # a fixture, used by name

MIRA, ANN, VIP = "minds/mira", "minds/ann", "minds/vip"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Once upon a time"}]


def test_chat_streamed_chat_and_completions_run_on_her_slot(
    llama_server_bin: Path, model: TinyModel
) -> None:
    async def body(e: Engine) -> None:
        agent = e.agent()
        reply = await agent.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=4, extra_body=ENDLESS
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        note = (reply.model_extra or {})["continuum"]
        assert (note["slot"], note["nPredict"], note["capped"]) == (1, 4, False)
        slots = await e.slots()
        assert slots[1]["id_task"] >= 0 and "id_task" not in slots[0]  # hers only

        stream = await agent.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=6, stream=True, extra_body=ENDLESS
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert (chunks[-1].model_extra or {})["continuum"]["slot"] == 1

        done = await agent.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=3, extra_body=ENDLESS
        )
        assert done.usage is not None and done.usage.completion_tokens == 3
        assert "id_task" not in (await e.slots())[0]

    run_engine(llama_server_bin, model, table(granted()), body)


def test_the_grant_caps_a_chat_counting_the_prompt_after_the_template(
    llama_server_bin: Path, model: TinyModel
) -> None:
    async def body(e: Engine) -> None:
        agent = e.agent()
        reply = await agent.chat.completions.create(
            model="tiny", messages=HELLO, max_completion_tokens=100_000, extra_body=ENDLESS
        )
        assert reply.usage is not None
        note = (reply.model_extra or {})["continuum"]
        # The gateway's count of the templated prompt is llama-server's own.
        assert note["nPredict"] == 96 - reply.usage.prompt_tokens
        assert reply.usage.completion_tokens == note["nPredict"]
        assert note["cutOff"] == "GrantTokens"

        long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(openai.BadRequestError) as caught:
            await agent.chat.completions.create(model="tiny", messages=long)
        assert caught.value.code == "context_length_exceeded"
        assert "grant" in caught.value.message

        with pytest.raises(openai.BadRequestError) as refused:
            await agent.chat.completions.create(model="tiny", messages=HELLO, n=2)
        assert refused.value.param == "n"
        assert "id_task" not in (await e.slots())[0]  # n=2 never reached another slot

        queued = e.agent(ANN)
        with pytest.raises(openai.RateLimitError) as waiting:
            await queued.chat.completions.create(model="tiny", messages=HELLO)
        assert waiting.value.response.headers["retry-after"] == "2"

    ann = TableEntry(ANN, GrantState.QUEUED, "PoolFull")
    run_engine(llama_server_bin, model, table(granted(tokens=96), ann), body)


def test_a_reclaim_during_a_stream_ends_it_within_the_grace(
    llama_server_bin: Path, model: TinyModel
) -> None:
    grace = 10.0

    async def body(e: Engine) -> None:
        stream = await e.agent().chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=4000, stream=True, extra_body=ENDLESS
        )
        seen, cut_at = 0, 0.0
        with pytest.raises(openai.APIError) as caught:
            async for _ in stream:
                seen += 1
                if seen == 5:
                    cut_at = time.monotonic()
                    reclaim = TableEntry(
                        MIRA,
                        GrantState.RECLAIMING,
                        "Preempted",
                        slot=1,
                        tokens=SLOT_TOKENS,
                        by=VIP,
                        deadline=time.time() + grace,
                        since="r1",
                    )
                    e.gateway.set_table(table(reclaim))
        ended = time.monotonic() - cut_at
        assert "turn cut" in caught.value.message and "Preempted" in caught.value.message
        assert ended < 2.0, ended
        deadline = time.monotonic() + grace
        while not e.gateway.releases():
            assert time.monotonic() < deadline, "no release within the grace"
            await asyncio.sleep(0.05)
        [release] = e.gateway.releases()
        assert (release.slot, release.reason) == (1, "Preempted")
        assert (await e.slots())[1]["is_processing"] is False

    run_engine(llama_server_bin, model, table(granted()), body)


def test_an_engine_of_one_slot_embeds_for_her(llama_server_bin: Path, model: TinyModel) -> None:
    async def body(e: Engine) -> None:
        emb = await e.agent().embeddings.create(model="tiny", input="Once upon a time")
        assert len(emb.data[0].embedding) == model.shape.n_embd

    args = ("-c", "2048", "--parallel", "1", "-t", "2", "--embeddings", "--pooling", "mean")
    run_engine(llama_server_bin, model, table(granted(slot=0, tokens=2048)), body, args)


def test_her_token_is_her_key_and_no_other_accounts_is(
    llama_server_bin: Path, model: TinyModel, cluster: Cluster, namespace: str
) -> None:
    """Real TokenReviews in front of the real llama-server: the official client's API key is her
    projected token with the engine's audience."""

    from continuum_operator.door.token_review import TokenReviewer

    audience = engine_audience(namespace, "tiny")
    for account in ("mira", "mira-child"):
        cluster.kubectl("create", "serviceaccount", account, "-n", namespace)

    def token(account: str, *audiences: str) -> str:
        flags = [f"--audience={a}" for a in audiences]
        out = cluster.kubectl("create", "token", account, "-n", namespace, *flags).stdout
        return str(out).strip()

    mine, plain, child = token("mira", audience), token("mira"), token("mira-child", audience)
    mira = f"{namespace}/mira"

    async def body(e: Engine) -> None:
        def agent(key: str, mind: str | None = None) -> openai.AsyncOpenAI:
            c = openai.AsyncOpenAI(
                base_url=f"{e.url}/v1",
                api_key=key,
                default_headers={MIND_HEADER: mind} if mind else None,
                max_retries=0,
            )
            e.clients.append(c)
            return c

        reply = await agent(mine).chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=3, extra_body=ENDLESS
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert (reply.model_extra or {})["continuum"]["slot"] == 1
        with pytest.raises(openai.AuthenticationError):  # the API server's audience only
            await agent(plain).chat.completions.create(model="tiny", messages=HELLO)
        with pytest.raises(openai.PermissionDeniedError):  # another account naming her
            await agent(child, mira).chat.completions.create(model="tiny", messages=HELLO)
        assert "id_task" not in (await e.slots())[0]
        await reviewer.close()

    reviewer = TokenReviewer(audience, kubeconfig=str(cluster.kubeconfig))
    run_engine(llama_server_bin, model, table(granted(mira)), body, review_token=reviewer)
