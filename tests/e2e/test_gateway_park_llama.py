"""Parked contexts with the real llama-server behind the gateway (docs/gateway.md, "A turn cut
off"): a reclaimed mind's slot saved before its erase and restored into her next slot, where
llama-server reuses it (it reports the prompt tokens it did not evaluate); another mind given
her old slot sees nothing of it; a park that cannot finish before the deadline erases on time;
a full store evicts the oldest park; her Mind deleted, her park goes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.engine.admission import GrantTable
from tests.support.gateway_llama import (
    ANN,
    MIRA,
    VIP,
    Engine,
    granted,
    model,
    queued,
    reclaiming,
    run_engine,
    table,
)
from tests.support.llama_server import TinyModel

pytestmark = pytest.mark.e2e

__all__ = ["model"]  # the module's fixture, used here by name

# 2,000 prompt tokens of the tiny model (1 KiB of KV each: 2 MB a park); 3 MiB holds one.
PROMPT = [3 + (i * 7) % 500 for i in range(2000)]
MORE = [5, 6, 7, 8]
BUDGET = 3 * 2**20


async def ask(e: Engine, mind: str, prompt: list[int]) -> dict[str, Any]:
    status, opened = await e.open(mind)
    assert status == 201, opened
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0.0}
    status, reply = await e.complete(mind, opened["turn"], body)
    assert status == 200, reply
    return dict(reply)


async def reclaim(e: Engine, mind: str, slot: int, others: GrantTable, grace: float = 10.0) -> Any:
    """Her slot reclaimed, the others' entries as given: her release, once reported and its
    park (saved behind the release) ended."""
    entries = {**others.entries, mind: reclaiming(mind, slot, grace)}
    e.gateway.set_table(GrantTable(others.slot_tokens, others.phase, entries))
    deadline = time.monotonic() + 30

    def hers() -> Any:
        return next((r for r in e.gateway.releases() if r.mind == mind), None)

    while (r := hers()) is None or r.parked_tokens is None:
        assert time.monotonic() < deadline, "never released"
        await asyncio.sleep(0.02)
    return r


def run_parking(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path, initial: GrantTable, body: Any
) -> dict[str, Any]:
    """The engine of tests/support/gateway_llama.py with a park store of BUDGET under
    tmp_path/park."""
    return run_engine(
        llama_server_bin,
        model,
        tmp_path,
        initial,
        body,
        park_dir=tmp_path / "park",
        park_budget_bytes=BUDGET,
    )


def parks(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("park-*"))


def test_a_reclaimed_mind_resumes_where_she_was_and_nobody_else_sees_it(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    store = tmp_path / "park"

    async def body(e: Engine) -> None:
        first = await ask(e, MIRA, PROMPT)
        assert first["timings"]["prompt_n"] >= len(PROMPT)
        release = await reclaim(e, MIRA, 0, table(queued(ANN), granted(VIP, 1)))
        assert release.parked_tokens >= len(PROMPT) and release.not_parked is None
        assert release.erased_tokens >= len(PROMPT)  # erased after the park, as before
        assert len(parks(store)) == 1
        # Ann is given Mira's old slot: the same prompt is evaluated whole, nothing reused.
        e.gateway.set_table(table(queued(MIRA), granted(ANN, 0), granted(VIP, 1)))
        ann = await ask(e, ANN, PROMPT)
        assert ann["timings"]["cache_n"] == 0 and "resumed" not in ann["continuum"]
        # Mira granted again, on the other slot: her context is restored before her request.
        e.gateway.set_table(table(granted(MIRA, 1), granted(ANN, 0), queued(VIP)))
        mira = await ask(e, MIRA, PROMPT + MORE)
        restored = mira["continuum"]["resumed"]["restoredTokens"]
        assert restored >= len(PROMPT)
        assert mira["timings"]["cache_n"] >= len(PROMPT)  # llama-server did not evaluate them
        assert mira["timings"]["prompt_n"] <= len(MORE) + 1
        assert parks(store) == []

    doc = run_parking(
        llama_server_bin, model, tmp_path, table(granted(MIRA, 0), granted(VIP, 1)), body
    )
    assert doc["park"]["budgetBytes"] == BUDGET and doc["park"]["parkedContexts"] == 0


def test_a_full_store_evicts_the_oldest_and_a_deleted_mind_takes_hers(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    store = tmp_path / "park"

    async def body(e: Engine) -> None:
        await ask(e, MIRA, PROMPT)
        await ask(e, ANN, PROMPT[::-1])
        await reclaim(e, MIRA, 0, table(granted(ANN, 1)))
        (mira_park,) = parks(store)
        everyone = table(queued(MIRA), granted(ANN, 1))
        release = await reclaim(e, ANN, 1, everyone)
        assert release.parked_tokens >= len(PROMPT)
        assert mira_park not in parks(store) and len(parks(store)) == 1  # the oldest went
        assert e.gateway.park is not None and list(e.gateway.park.parked) == [ANN]
        e.gateway.set_table(table(queued(MIRA)))  # Ann's Mind deleted: her park goes too
        assert parks(store) == []

    run_parking(llama_server_bin, model, tmp_path, table(granted(MIRA, 0), granted(ANN, 1)), body)


def test_a_park_that_cannot_finish_before_the_deadline_erases_on_time(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    store = tmp_path / "park"

    async def body(e: Engine) -> None:
        await ask(e, MIRA, PROMPT)
        started = time.time()
        release = await reclaim(e, MIRA, 0, table(granted(VIP, 1)), grace=0.4)
        assert release.at - started < 0.4  # released before its deadline
        assert (release.parked_tokens, release.not_parked) == (0, "NoTime")
        assert release.erased_tokens >= len(PROMPT)
        assert parks(store) == []

    run_parking(llama_server_bin, model, tmp_path, table(granted(MIRA, 0), granted(VIP, 1)), body)
