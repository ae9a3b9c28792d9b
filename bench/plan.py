"""Timing of the serving plan: one plan, and a fleet's worth of best-fit placement.

    python bench/plan.py [--engines 5000] [--boards 1000] [--sample 500] [--budget-s 180]

(a) One plan: the median wall time of `core.plan.plan` over 1,000 runs of the m5 example
    (examples/boards/m5-unified.yaml x examples/engines/agent-32b.yaml), files already parsed.
(b) Best fit: a deterministic mix (random.Random(0)) of boards (unified, discrete with 1-8 GPUs,
    unknown; varied sizes and usage) and engines (16-96 layers, varied sizes, contexts, minds, KV
    types and offload). Each engine is planned on every board and placed on the best fit: the
    schedulable plan with the highest (layersOnDevice, poolTokens), ties to the least leftover
    budget. Placement is stateless: boards are not charged with the engines placed before.

The first --sample engines are always measured against every board. If the whole run would fit
in --budget-s (judged from the sample), the rest are measured too; otherwise the full figure is
extrapolated from the sample at the sample's plans per second, and the output says so.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from continuum_operator.core.plan import ServingPlan, plan  # noqa: E402
from continuum_operator.core.pools import Board, Ledger  # noqa: E402
from continuum_operator.manifests import load_one  # noqa: E402
from continuum_operator.model.board import NodeBoard  # noqa: E402
from continuum_operator.model.engine import Engine, EngineSpec, ModelFacts  # noqa: E402

GiB = 2**30
GB = 10**9
MB = 10**6


def one_plan(runs: int = 1000) -> float:
    """Median seconds of one plan of the m5 example."""
    board = Board.from_resource(load_one(NodeBoard, ROOT / "examples/boards/m5-unified.yaml"))
    engine = load_one(Engine, ROOT / "examples/engines/agent-32b.yaml")
    facts = engine.spec.model.facts
    assert facts is not None
    ledger = Ledger(board)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        plan(board, engine.spec, facts, ledger)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _board(rng: random.Random, i: int) -> dict[str, Any]:
    roll = rng.random()
    status: dict[str, Any]
    if roll < 0.3:  # unified: Apple silicon, GB10, integrated GPUs
        capacity = rng.choice([16, 24, 32, 36, 48, 64, 96, 128, 192, 512]) * GiB
        used = int(capacity * rng.uniform(0.05, 0.9))
        status = {
            "memoryMode": "unified",
            "pools": [{"kind": "unified", "capacityBytes": capacity, "usedBytes": used}],
        }
        if rng.random() < 0.6:  # a working-set hint, as Metal gives
            status["perProcessCapBytes"] = int(capacity * rng.uniform(0.6, 0.8))
    elif roll < 0.8:  # discrete, 1-8 GPUs of one kind
        gpu = int(rng.choice([8, 12, 16, 24, 40, 48, 80, 94, 141]) * GB * 0.97)
        host = rng.choice([32, 64, 128, 256, 512, 1024]) * GiB
        pools: list[dict[str, Any]] = [
            {"kind": "host", "capacityBytes": host, "usedBytes": int(host * rng.uniform(0.02, 0.7))}
        ]
        coherent = rng.random() < 0.1
        for g in range(rng.randint(1, 8)):
            busy = rng.random() < 0.3
            used = int(gpu * (rng.uniform(0.3, 0.95) if busy else rng.uniform(0.0, 0.05)))
            pools.append(
                {
                    "kind": "device",
                    "device": g,
                    "capacityBytes": gpu,
                    "usedBytes": used,
                    "coherent": coherent,
                }
            )
        status = {"memoryMode": "discrete", "pools": pools}
    else:  # unknown: no backend reported; host governed only
        host = rng.choice([16, 32, 64, 128, 256]) * GiB
        status = {
            "memoryMode": "unknown",
            "pools": [
                {
                    "kind": "host",
                    "capacityBytes": host,
                    "usedBytes": int(host * rng.uniform(0.05, 0.8)),
                }
            ],
        }
    if rng.random() < 0.03:  # an agent that has not sampled yet
        for pool in status["pools"]:
            pool.pop("usedBytes")
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "NodeBoard",
        "metadata": {"name": f"node-{i:04d}"},
        "status": status,
    }


def _engine(rng: random.Random, i: int) -> dict[str, Any]:
    layers = rng.randint(16, 96)
    layer_bytes = rng.randint(40 * MB, 1200 * MB)
    facts: dict[str, Any] = {
        "layers": layers,
        "layerBytes": layer_bytes,
        "inputBytes": rng.randint(100 * MB, 1500 * MB),
        "outputBytes": rng.randint(100 * MB, 1500 * MB),
        "kvBytesPerTokenPerLayer": rng.choice([1024, 2048, 4096, 8192, 16384]),
        "embeddingLength": rng.choice([2048, 3072, 4096, 5120, 8192]),
        "vocabSize": rng.choice([32000, 128256, 152064, 262144]),
    }
    if rng.random() < 0.1:  # per-layer sizes, as mixed quantisations give
        facts["layerBytes"] = [int(layer_bytes * rng.uniform(0.8, 1.2)) for _ in range(layers)]
    if rng.random() < 0.5:
        facts["computeBytes"] = rng.randint(200 * MB, 2000 * MB)
    lo = rng.randint(1, 4)
    spec: dict[str, Any] = {
        "model": {"facts": facts},
        "contextTokensPerMind": rng.choice([2048, 4096, 8192, 16384, 32768, 65536, 131072]),
        "minds": {"min": lo, "max": lo + rng.randint(0, 8)},
        "kvCacheType": rng.choice(["f16", "f16", "q8_0", "q4_0", "f32"]),
    }
    offload = rng.random()
    if offload < 0.1:
        spec["offload"] = "all"
    elif offload < 0.15:
        spec["offload"] = "none"
    elif offload < 0.3:
        spec["offload"] = rng.randint(0, layers + 1)
    placement: dict[str, Any] = {}
    if rng.random() < 0.1:
        placement["gpus"] = rng.choice([2, 4, 8])
    if rng.random() < 0.2:
        placement["deviceBudgetBytes"] = rng.choice([8, 16, 24, 48]) * GiB
    if placement:
        spec["placement"] = placement
    if rng.random() < 0.03:  # more than any board holds: 16 minds of 128k tokens at f16
        spec["minds"] = {"min": 16, "max": 16}
        spec["contextTokensPerMind"] = 131072
        spec["kvCacheType"] = "f16"
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"name": f"engine-{i:04d}", "namespace": "bench"},
        "spec": spec,
    }


def fleet(engines: int, boards: int) -> tuple[list[Board], list[EngineSpec]]:
    rng = random.Random(0)
    board_list = [
        Board.from_resource(NodeBoard.model_validate(_board(rng, i))) for i in range(boards)
    ]
    engine_list = [Engine.model_validate(_engine(rng, i)).spec for i in range(engines)]
    return board_list, engine_list


def _leftover(p: ServingPlan) -> int:
    """Budget a plan leaves unused, summed over the sides it is governed on."""
    b = p.budget
    if b.shared is not None:
        return b.shared - p.device.in_use - p.host.in_use
    left = 0
    if b.device is not None:
        left += b.device - p.device.in_use
    if b.host is not None:
        left += b.host - p.host.in_use
    return left


def best_fit(
    spec: EngineSpec, boards: list[tuple[Board, Ledger]]
) -> tuple[ServingPlan | None, int]:
    facts: ModelFacts | None = spec.model.facts
    assert facts is not None
    best: ServingPlan | None = None
    best_key: tuple[int, int, int] | None = None
    for board, ledger in boards:
        p = plan(board, spec, facts, ledger)
        if not p.schedulable:
            continue
        key = (p.layers_on_device, p.pool_tokens, -_leftover(p))
        if best_key is None or key > best_key:
            best, best_key = p, key
    return best, len(boards)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=5000)
    ap.add_argument("--boards", type=int, default=1000)
    ap.add_argument("--sample", type=int, default=500, help="engines always measured")
    ap.add_argument("--budget-s", type=float, default=180.0, help="longest full run to measure")
    ap.add_argument("--runs", type=int, default=1000, help="runs of the single plan")
    args = ap.parse_args(argv)

    median = one_plan(args.runs)
    print(f"(a) one plan (m5 example, median of {args.runs:,}): {median * 1e6:,.1f} us")

    t = time.perf_counter()
    boards, engines = fleet(args.engines, args.boards)
    print(
        f"(b) fleet: {len(engines):,} engines x {len(boards):,} boards, "
        f"generated and validated in {time.perf_counter() - t:.1f} s (not timed below)"
    )
    kinds: dict[str, int] = {}
    for b in boards:
        kinds[str(b.memory_mode)] = kinds.get(str(b.memory_mode), 0) + 1
    print("    boards: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))

    with_ledgers = [(b, Ledger(b)) for b in boards]
    placed = unplaceable = plans = 0
    full_on_device = 0
    measured = 0
    start = time.perf_counter()
    for i, spec in enumerate(engines):
        if i == args.sample and i < len(engines):
            elapsed = time.perf_counter() - start
            projected = elapsed / i * len(engines)
            if projected > args.budget_s:
                print(
                    f"    measured the first {i:,} engines in {elapsed:.1f} s; the whole run "
                    f"would take about {projected:.0f} s (> --budget-s {args.budget_s:.0f}), "
                    "so the rest is extrapolated"
                )
                break
        best, n = best_fit(spec, with_ledgers)
        plans += n
        measured += 1
        if best is None:
            unplaceable += 1
        else:
            placed += 1
            full_on_device += best.gpu_servable
    elapsed = time.perf_counter() - start
    rate = plans / elapsed
    print(
        f"    measured: {measured:,} engines x {len(boards):,} boards = {plans:,} plans "
        f"in {elapsed:.1f} s: {rate:,.0f} plans/s ({elapsed / measured * 1e3:,.1f} ms per engine)"
    )
    print(
        f"    measured engines placed: {placed:,}, unplaceable: {unplaceable:,} "
        f"(placed with every layer on the device: {full_on_device:,})"
    )
    total_plans = len(engines) * len(boards)
    if measured < len(engines):
        print(
            f"    extrapolated: {len(engines):,} engines x {len(boards):,} boards = "
            f"{total_plans:,} plans at {rate:,.0f} plans/s: about {total_plans / rate:,.0f} s "
            f"({total_plans / rate / 60:.1f} min) on one core; placement counts above are the "
            "measured engines only"
        )
    else:
        print(f"    total: {total_plans:,} plans in {elapsed:.1f} s (all measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
