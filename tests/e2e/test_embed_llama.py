"""Embed lanes on the real llama.cpp (llama-cpp-python, CPU): `continuum embed` serves
embeddings, calibrates, reports its receipts and largest context, and its bytes are charged
where the lane resides (docs/design.md rule 6). The model is a generated random-weight embedding
GGUF (mean pooling); nothing is downloaded."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator import yaml_text
from continuum_operator.core.embed import (
    LaneAsk,
    LanePlacement,
    LaneReason,
    LaneSizer,
    LaneVerdict,
    Residence,
    place_lane,
    residence,
)
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.receipts import Receipt, is_host_buffer
from continuum_operator.embed.lane import LaneModel
from continuum_operator.embed.runtime import LaneRuntime, LaneState, lane_state_from
from continuum_operator.gguf import file_sha256, read_facts
from continuum_operator.model.engine import EngineSpec, ModelFacts
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from tests.support.builders import GiB, MiB, board, board_body
from tests.support.llama_server import import_llama_cpp
from tests.support.local_http import free_port, http_json
from tests.support.operator_process import scrape_metric

pytestmark = pytest.mark.e2e

LANE = "EmbedLane/ns/lane"
SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, vocab_size=512,
                       context_length=4096, embedding=True)  # fmt: skip
LONG = " ".join(["the lane embeds memory of a node"] * 200)  # well over 1,000 tokens


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import_llama_cpp()
    return write_tiny_gguf(tmp_path_factory.mktemp("embed") / "tiny-embed.gguf", SHAPE, seed=1)


@pytest.fixture(scope="module")
def facts(embed_model: Path) -> ModelFacts:
    return read_facts(embed_model)


def lane_model(path: Path) -> LaneModel:
    return LaneModel(path, model_sha256=file_sha256(path), n_threads=2)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def receipts_of(status: dict[str, Any]) -> tuple[Receipt, ...]:
    return tuple(Receipt.model_validate(r) for r in status["receipts"])


def discrete_board(host: int = 64 * GiB, device: int = 24 * GiB) -> Board:
    return board(board_body("discrete", [
        {"kind": "host", "capacityBytes": host, "usedBytes": 0},
        {"kind": "device", "device": 0, "capacityBytes": device, "usedBytes": 0},
    ]))  # fmt: skip


def placed_lane(
    b: Board, status: dict[str, Any], facts: ModelFacts, *, offloads: bool | None,
    layers: int, total: int, leases: list[Lease] | None = None, max_ctx: int = 2048,
    floors: dict[str, int] | None = None,
) -> LanePlacement:  # fmt: skip
    where, why = residence(backend_offloads=offloads, layers_on_device=layers, total_layers=total)
    return place_lane(
        b,
        BoardLeases.of(b, leases or []),
        LaneAsk(LANE, max_ctx, status["largestContextTokens"], floors or {}),
        LaneSizer(facts, receipts_of(status)),
        where=where,
        residence_reason=why,
        gpus=[0],
    )


# --- served over HTTP ----------------------------------------------------------------------


@pytest.fixture
def served_lane(embed_model: Path, tmp_path: Path) -> Iterator[tuple[str, Path, Path, str]]:
    """(the embeddings' address, the lane file, the status file, the admin address). No
    cluster here, so no token review: its door is tests/e2e/test_embed_door.py's."""
    lane_file = tmp_path / "lane.yaml"
    lane_file.write_text(yaml_text.dump({
        "apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
        "metadata": {"name": "lane", "namespace": "ns"},
        "spec": {"engine": "eng", "maxContextTokens": 2048},
        "status": {"placement": {"node": "n", "verdict": "Fits", "residence": "host",
                                 "contextTokens": 1024, "pools": []}},
    }))  # fmt: skip
    status_file = tmp_path / "runtime.json"
    port, admin_port = free_port(), free_port()
    log = (tmp_path / "embed.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from continuum_operator.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "embed", "--model", str(embed_model),
         "--lane-file", str(lane_file), "--listen", f"127.0.0.1:{port}",
         "--admin-listen", f"127.0.0.1:{admin_port}", "--unsafe-no-review",
         "--status-file", str(status_file)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "embed.log").read_text()
            try:
                if http_json(f"{url}/readyz", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(
                "continuum embed never became ready:\n" + (tmp_path / "embed.log").read_text()
            )
        yield url, lane_file, status_file, f"http://127.0.0.1:{admin_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_continuum_embed_serves_mean_pooled_embeddings_and_reports_its_runtime(
    served_lane: tuple[str, Path, Path, str],
) -> None:
    url, _, status_file, admin = served_lane
    code, body = http_json(f"{url}/v1/embeddings", {"input": ["hello world", "the token pool",
                                                              "hello world"]})  # fmt: skip
    assert code == 200, body
    vectors = [d["embedding"] for d in body["data"]]
    assert [len(v) for v in vectors] == [SHAPE.n_embd] * 3
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-3) for v in vectors)

    def cosine(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(vectors[0], vectors[2]) > 0.9999  # the same text, embedded the same
    assert cosine(vectors[0], vectors[1]) < 0.999
    assert body["usage"]["prompt_tokens"] > 3

    code, runtime = http_json(f"{admin}/v1/runtime")
    assert code == 200
    assert runtime["phase"] == "Serving" and runtime["gpuOffload"] is False
    assert runtime["largestContextTokens"] >= 1  # the calibration pass
    assert runtime["requests"]["served"] == 1
    assert runtime["receipts"], "a load is receipted"
    assert json.loads(status_file.read_text())["requests"]["served"] == 1

    code, refused = http_json(f"{url}/v1/embeddings", {"input": LONG * 3})
    assert code == 413 and refused["error"]["reason"] == "ContextTooLarge"

    # The same counts at /metrics, current at the scrape (docs/metrics.md).
    metrics = f"{admin}/metrics"
    assert scrape_metric(metrics, "continuum_lane_requests_served_total") == 1
    assert scrape_metric(metrics, "continuum_lane_inputs_embedded_total") == 3
    tokens = scrape_metric(metrics, "continuum_lane_tokens_embedded_total")
    assert tokens == body["usage"]["prompt_tokens"]
    largest = scrape_metric(metrics, "continuum_lane_largest_context_tokens")
    assert largest == runtime["largestContextTokens"]
    assert scrape_metric(metrics, "continuum_lane_leased_context_tokens") == 1024
    refusals = "continuum_lane_refusals_total"
    assert scrape_metric(metrics, refusals, reason="ContextTooLarge") == 1
    assert scrape_metric(metrics, refusals, reason="PoolBusy") == 0


def test_a_request_above_the_lease_waits_for_the_lease_to_grow(
    served_lane: tuple[str, Path, Path, str],
) -> None:
    url, lane_file, _, admin = served_lane
    text = " ".join(["memory"] * 1500)
    code, body = http_json(f"{url}/v1/embeddings", {"input": text})
    assert code == 503 and body["error"]["reason"] == "PoolBusy"
    doc = yaml.safe_load(lane_file.read_text())
    doc["status"]["placement"]["contextTokens"] = 2048

    def grow() -> None:
        time.sleep(1.0)
        lane_file.write_text(yaml_text.dump(doc))

    import threading

    threading.Thread(target=grow).start()
    code, body = http_json(f"{url}/v1/embeddings", {"input": text, "waitSeconds": 20})
    assert code == 200, body
    _, runtime = http_json(f"{admin}/v1/runtime")
    assert runtime["requests"]["waited"] == 1
    assert runtime["largestContextTokens"] <= runtime["contextTokens"] <= 2048
    assert runtime["largestContextTokens"] > 1500


# --- charged where it resides --------------------------------------------------------------


def test_a_host_only_backend_is_charged_to_the_host_and_never_to_the_device(
    embed_model: Path, facts: ModelFacts
) -> None:
    model = lane_model(embed_model)
    rt = LaneRuntime(model, LaneState(max_context_tokens=2048, leased_context_tokens=2048))
    try:
        run(rt.calibrate())
        code, _ = run(rt.embed(["a node and a pool"]))
        assert code == 200
        status = rt.status()
    finally:
        model.close()
    assert status["gpuOffload"] is False  # this llama.cpp cannot offload
    receipts = receipts_of(status)
    assert receipts and all(is_host_buffer(b.device) for r in receipts for b in r.buffers)
    # The engine beside it offloads every layer; the lane still lives on the host.
    p = placed_lane(discrete_board(), status, facts, offloads=status["gpuOffload"],
                    layers=facts.layers + 1, total=facts.layers + 1)  # fmt: skip
    assert p.verdict is LaneVerdict.FITS and p.residence is Residence.HOST
    assert p.residence_reason is LaneReason.HOST_BACKEND
    assert p.source is LaneReason.RECEIPT_USED
    assert set(p.charges) == {"host"} and p.charges["host"] > 0
    assert all(lease.pool == "host" for lease in p.leases())


def test_a_split_lane_is_charged_in_both_pools(embed_model: Path, facts: ModelFacts) -> None:
    model = lane_model(embed_model)
    rt = LaneRuntime(model, LaneState(max_context_tokens=1024, leased_context_tokens=1024))
    try:
        run(rt.calibrate())
        status = rt.status()
    finally:
        model.close()
    # On a GPU node the engine's runtime reports gpuOffload true; its plan puts 2 of 5 layers
    # on the device, so the lane's context may land on either side.
    p = placed_lane(discrete_board(), status, facts, offloads=True, layers=2,
                    total=facts.layers + 1, max_ctx=1024)  # fmt: skip
    assert p.residence is Residence.SPLIT and p.verdict is LaneVerdict.FITS
    measured = LaneSizer(facts, receipts_of(status)).bytes_at(1024)[0].total
    assert p.charges == {"host": measured, "device/0": measured}
    assert {lease.pool for lease in p.leases()} == {"host", "device/0"}


def test_floors_rise_with_the_largest_context_embedded_and_never_fall(
    embed_model: Path, facts: ModelFacts
) -> None:
    model = lane_model(embed_model)
    rt = LaneRuntime(model, LaneState(max_context_tokens=4096, leased_context_tokens=4096))
    b = discrete_board()
    floors: dict[str, int] = {}
    seen: list[tuple[int, int, int]] = []
    try:
        run(rt.calibrate())
        for text in ("a pool", " ".join(["memory"] * 700), " ".join(["memory"] * 1800), "tiny"):
            code, _ = run(rt.embed([text]))
            assert code == 200
            status = rt.status()
            p = placed_lane(b, status, facts, offloads=False, layers=0, total=5, max_ctx=4096,
                            floors=floors)  # fmt: skip
            floors = dict(p.floors)
            seen.append((status["largestContextTokens"], status["contextTokens"], floors["host"]))
    finally:
        model.close()
    largest = [s[0] for s in seen]
    held = [s[1] for s in seen]
    host_floor = [s[2] for s in seen]
    assert largest == sorted(largest) and largest[2] > 1800 and largest[3] == largest[2]
    assert held[1] == 768 and held[2] == 2048  # the context grows in llama.cpp's steps
    assert host_floor[0] < host_floor[1] < host_floor[2] == host_floor[3]
    # The floor is the measured bytes of the largest context: a receipt at that context exists.
    assert any(r.context_tokens == 2048 for r in receipts_of(status))


def test_a_request_too_large_for_the_pool_is_refused_without_disturbing_the_engine_plan(
    embed_model: Path, facts: ModelFacts
) -> None:
    # An engine on the host fills most of a small host pool; the lane gets what is left.
    engine = EngineSpec.model_validate({
        "model": {"facts": facts.model_dump(by_alias=True, exclude_none=True)},
        "contextTokensPerMind": 1024, "minds": {"min": 1, "max": 2}, "offload": "none",
        "reserveBytes": 0,
    })  # fmt: skip
    model = lane_model(embed_model)
    rt = LaneRuntime(model, LaneState(max_context_tokens=4096, leased_context_tokens=4096))
    try:
        run(rt.calibrate())
        calibrated = rt.status()
        sizer = LaneSizer(facts, receipts_of(calibrated))
        room = sizer.bytes_at(256)[0].total + MiB  # the pool holds one context step, no more
        b0 = discrete_board(host=64 * GiB)
        engine_plan = plan(b0, engine, facts)
        engine_bytes = dict(engine_plan.charges)["host"]
        b = discrete_board(host=engine_bytes + room)
        eng = [Lease("Engine/ns/eng", ConsumerKind.ENGINE, b.node, "host", engine_bytes)]
        p = placed_lane(b, calibrated, facts, offloads=False, layers=0, total=5,
                        leases=eng, max_ctx=4096)  # fmt: skip
        assert p.verdict is LaneVerdict.FITS and p.reason is LaneReason.LIMITED_BY_POOL
        assert p.context_tokens == 256
        rt.set_state(lane_state_from({"spec": {"maxContextTokens": 4096},
                                      "status": {"placement": p.to_dict()}}))  # fmt: skip
        before = plan(
            b, engine, facts, BoardLeases.of(b, [*eng, *p.leases()]), crediting="Engine/ns/eng"
        )

        code, body = run(rt.embed([" ".join(["memory"] * 900)]))
        assert code == 503 and body["error"]["reason"] == "PoolBusy"
        assert "256" in body["error"]["message"]
        code, body = run(rt.embed([LONG * 4]))
        assert code == 413 and body["error"]["reason"] == "ContextTooLarge"
        after_status = rt.status()
        assert after_status["contextTokens"] == 256  # it never grew past its lease
        assert after_status["requests"]["refused"] == 2
        again = placed_lane(
            b,
            after_status,
            facts,
            offloads=False,
            layers=0,
            total=5,
            leases=[*eng, *p.leases()],
            max_ctx=4096,
            floors=dict(p.floors),
        )
        after = plan(b, engine, facts, BoardLeases.of(b, [*eng, *again.leases()]),
                     crediting="Engine/ns/eng")  # fmt: skip
    finally:
        model.close()
    assert again.leases() == p.leases()
    assert after == before
    assert before.schedulable and before.minds_grantable == engine_plan.minds_grantable


def test_a_lane_not_yet_placed_allocates_nothing_until_its_lease_arrives(embed_model: Path) -> None:
    model = lane_model(embed_model)
    rt = LaneRuntime(model, LaneState(max_context_tokens=2048))

    async def scenario() -> tuple[int, int, str]:
        calibration = asyncio.create_task(rt.calibrate())
        await asyncio.sleep(0.3)
        before = model.cells
        refused, body = await rt.embed(["a node"])
        rt.set_state(LaneState(max_context_tokens=2048, leased_context_tokens=512))
        await asyncio.wait_for(calibration, 30)
        return before, refused, body["error"]["reason"]

    try:
        before, refused, reason = run(scenario())
        assert before == 0 and refused == 503 and reason == "Calibrating"
        assert rt.status()["phase"] == "Serving" and model.cells == 256
        code, _ = run(rt.embed(["a node"]))
        assert code == 200
    finally:
        model.close()


def test_request_counts_alone_are_written_at_most_once_an_interval(embed_model: Path) -> None:
    model = lane_model(embed_model)
    written: list[dict[str, Any]] = []
    now = [0.0]

    async def publish(doc: dict[str, Any]) -> None:
        written.append(doc)

    rt = LaneRuntime(model, LaneState(max_context_tokens=1024, leased_context_tokens=1024),
                     publish=publish, clock=lambda: now[0])  # fmt: skip
    try:
        run(rt.calibrate())
        assert len(written) == 1 and written[-1]["phase"] == "Serving"
        run(rt.embed(["a node and a pool of tokens"]))  # a larger context: written at once
        assert len(written) == 2 and written[-1]["largestContextTokens"] > 1
        for _ in range(3):
            run(rt.embed(["a node"]))  # counts only
        assert len(written) == 2
        now[0] += rt.counts_interval
        run(rt.publish_status(flush=True))
        assert len(written) == 3 and written[-1]["requests"]["served"] == 4
    finally:
        model.close()


@pytest.mark.parametrize(
    "shape",
    [
        SHAPE,
        TinyModelShape(n_layer=2, n_embd=256, n_head=8, n_head_kv=8, n_ff=512, vocab_size=2048,
                       context_length=4096, embedding=True),
        TinyModelShape(n_layer=6, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, vocab_size=8192,
                       context_length=4096, embedding=True),
        TinyModelShape(n_layer=2, n_embd=512, n_head=8, n_head_kv=2, n_ff=1536, vocab_size=1024,
                       context_length=4096, embedding=True),
    ],
    ids=["l4-e128", "l2-e256-v2k", "l6-e64-v8k", "l2-e512-f1536"],
)  # fmt: skip
def test_the_lane_estimate_is_never_under_what_llama_cpp_allocates(
    shape: TinyModelShape, tmp_path: Path
) -> None:
    """Until a receipt exists a lane is leased on the estimate: it must not be too small."""
    import_llama_cpp()
    path = write_tiny_gguf(tmp_path / "m.gguf", shape, seed=3)
    sizer = LaneSizer(read_facts(path))
    model = lane_model(path)
    try:
        for tokens in (256, 1024, 2048):
            loaded = model.calibrate(tokens)
            assert loaded is not None and loaded.receipt is not None
            allocated = LaneSizer(sizer.facts, (loaded.receipt,)).bytes_at(tokens)[0].total
            estimated = sizer.estimate(tokens).total
            assert allocated <= estimated <= 1.3 * allocated, (tokens, allocated, estimated)
    finally:
        model.close()
