"""Timing of the serving plan: one plan, and a fleet's worth of best-fit placement.

    python bench/plan.py [--engines 5000] [--boards 1000] [--repeat 3] [--sample 100]

(a) One plan: the median wall time of `core.plan.plan` over 1,000 runs of the m5 example
    (examples/boards/m5-unified.yaml x examples/engines/agent-32b.yaml), files already parsed.
(b) Best fit: a deterministic mix (random.Random(0)) of boards (unified, discrete with 1-8 GPUs,
    unknown; varied sizes and usage) and engines (16-96 layers, varied sizes, contexts, minds, KV
    types and offload), each placed by the operator's own decision (`core.bestfit`: every layer
    on the device first, then the most minds, then the tightest fit), and for an engine that
    fits nowhere the Unschedulable message the operator writes (`core.unfit.explain`).
    Placement is stateless: boards are not charged with the engines placed before, so the
    boards are read once (`bestfit.Fleet`) for the whole fleet.

The whole fleet is decided with the pre-filter (`core.prefilter`), in CPU seconds of this
process, --repeat times after a full garbage collection: the best and every run are printed (on
a shared machine the same pass varies by half). The old path (`prefilter=False`: the exact plan
of every board, as before the pre-filter) is measured on the first --sample engines in the same
run, and the two are compared decision by decision there; its figure for the whole fleet is
that sample's rate. Also printed: one Engine placed as the operator places it
(`bestfit.choose`, the boards read anew each time).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from continuum_operator.core.bestfit import Decision, Fleet, NodeView, choose  # noqa: E402
from continuum_operator.core.plan import ServingPlan, plan  # noqa: E402
from continuum_operator.core.pools import Board, BoardLeases  # noqa: E402
from continuum_operator.core.unfit import explain  # noqa: E402
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
    ledger = BoardLeases(board)
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


def _decide(fleet_: Fleet, spec: EngineSpec, *, prefilter: bool) -> tuple[Decision, str]:
    """The operator's decision for one Engine, and for one that fits nowhere its message."""
    facts: ModelFacts | None = spec.model.facts
    assert facts is not None
    decision = fleet_.choose(spec, facts, prefilter=prefilter)
    message = "" if decision.chosen is not None else explain(decision).message
    return decision, message


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=5000)
    ap.add_argument("--boards", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="passes over the whole fleet")
    ap.add_argument("--sample", type=int, default=100, help="engines also decided the old way")
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
    views = [NodeView(b, True) for b in boards]

    cpu = time.process_time()
    together = Fleet(views, [])
    together.rows()
    read = time.process_time() - cpu
    runs: list[float] = []
    for _ in range(max(1, args.repeat)):
        placed = unplaceable = full_on_device = plans = 0
        fast: list[tuple[ServingPlan | None, str]] = []
        gc.collect()
        cpu = time.process_time()
        for i, spec in enumerate(engines):
            decision, message = _decide(together, spec, prefilter=True)
            plans += decision.plans
            if decision.chosen is None:
                unplaceable += 1
            else:
                placed += 1
                full_on_device += decision.chosen.gpu_servable
            if i < args.sample:
                fast.append((decision.chosen, message))
        runs.append(time.process_time() - cpu)
    decided = min(runs)
    print(
        f"    with the pre-filter: the boards read once in {read * 1e3:,.1f} ms of CPU; "
        f"{len(engines):,} engines decided in {decided:.2f} s of CPU, best of {len(runs)} "
        f"(runs: {', '.join(f'{r:.2f}' for r in runs)} s; "
        f"{decided / len(engines) * 1e6:,.0f} us per engine), {plans:,} exact plans "
        f"(of {len(engines) * len(boards):,} node-engine pairs), all measured"
    )
    print(
        f"    placed: {placed:,}, unplaceable: {unplaceable:,} (each with its Unschedulable "
        f"message); placed with every layer on the device: {full_on_device:,}"
    )

    sample = engines[: args.sample]
    gc.collect()
    cpu = time.process_time()
    slow = [_decide(together, spec, prefilter=False) for spec in sample]
    old = time.process_time() - cpu
    differ = sum(
        1
        for (chosen, message), (decision, old_message) in zip(fast, slow, strict=True)
        if chosen != decision.chosen or message != old_message
    )
    per_engine_old = old / len(sample)
    per_engine_new = decided / len(engines)
    print(
        f"    the old path (every board planned exactly), the first {len(sample):,} engines: "
        f"{old:.1f} s of CPU ({per_engine_old * 1e3:,.1f} ms per engine; the whole fleet at "
        f"that rate about {per_engine_old * len(engines):,.0f} s); decisions and messages "
        f"that differ from the pre-filter's: {differ}"
    )
    print(f"    ratio, old path to pre-filter, per engine: {per_engine_old / per_engine_new:,.0f}x")

    cpu = time.process_time()
    for spec in sample:
        facts = spec.model.facts
        assert facts is not None
        choose(views, spec, facts, [])
    one = (time.process_time() - cpu) / len(sample)
    print(
        f"    as the operator calls it (`choose`, the {len(boards):,} boards read anew each "
        f"time): {one * 1e3:,.1f} ms of CPU per engine"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
