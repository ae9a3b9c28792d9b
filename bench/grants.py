"""Timing of the grant allocator at fleet scale, and of the simulator in virtual events.

    python bench/grants.py [--minds 50000] [--engines 5000] [--seed 0] [--sim-seconds 14400]

(a) Allocation: --minds minds spread over --engines engines (random.Random(seed): 1-16 slots of
    4k-32k tokens each, minds of priority 0-3 with contexts that sometimes exceed the slot).
    Four passes over every engine, each a full `allocate` call per engine as the operator makes
    on an event: arrival of all minds onto empty ledgers; a quiet re-run with nothing changed
    (what a resync costs); one mind in ten leaving and as many arriving at a higher priority
    (preemptions); and the releases reported for every reclaim. Prints the wall time per pass,
    per engine and per mind, and the transitions made.
(b) Simulation: examples/scenarios/mixed-priorities.yaml (one virtual hour), and a synthetic
    fleet of 50 engines and 500 minds for --sim-seconds of virtual time; prints virtual events
    per second of wall time.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from continuum_operator.core.grants import (  # noqa: E402
    Allocation,
    Capacity,
    EnginePhase,
    Grant,
    MindDemand,
    allocate,
)
from continuum_operator.core.simulate import (  # noqa: E402
    EngineScenario,
    MindScenario,
    Scenario,
    simulate,
)
from continuum_operator.model.mind import GrantState  # noqa: E402
from continuum_operator.scenario import load  # noqa: E402


def fleet(
    minds: int, engines: int, rng: random.Random
) -> tuple[list[Capacity], list[list[MindDemand]]]:
    capacities = [
        Capacity(EnginePhase.SERVING, rng.randint(1, 16), rng.choice([4096, 8192, 16384, 32768]))
        for _ in range(engines)
    ]
    demands: list[list[MindDemand]] = [[] for _ in range(engines)]
    for i in range(minds):
        e = rng.randrange(engines)
        demands[e].append(
            MindDemand(
                f"m{i}",
                priority=rng.randint(0, 3),
                arrival=rng.uniform(0, 60),
                context_tokens=rng.choice([2048, 4096, 8192, 16384, 65536]),
                protection_window=rng.choice([0.0, 60.0, 300.0]),
            )
        )
    return capacities, demands


def timed_pass(
    ledgers: list[dict[str, Grant]],
    demands: list[list[MindDemand]],
    capacities: list[Capacity],
    now: float,
    released: list[set[str]] | None = None,
) -> tuple[float, list[Allocation]]:
    start = time.perf_counter()
    results = [
        allocate(
            ledgers[i], demands[i], capacities[i], now, released=released[i] if released else ()
        )
        for i in range(len(capacities))
    ]
    return time.perf_counter() - start, results


def bench_allocation(minds: int, engines: int, seed: int) -> None:
    rng = random.Random(seed)
    capacities, demands = fleet(minds, engines, rng)
    print(f"(a) allocation: {minds:,} minds on {engines:,} engines "
          f"({sum(c.slots for c in capacities):,} slots)")  # fmt: skip
    ledgers: list[dict[str, Grant]] = [{} for _ in range(engines)]

    def report(label: str, seconds: float, results: list[Allocation]) -> None:
        moves = sum(len(r.transitions) for r in results)
        per_engine, per_mind = seconds / engines * 1e6, seconds / minds * 1e6
        print(f"    {label:<34} {seconds * 1000:9.1f} ms  {per_engine:7.1f} us/engine  "
              f"{per_mind:6.2f} us/mind  {moves:,} transitions")  # fmt: skip

    seconds, results = timed_pass(ledgers, demands, capacities, 100.0)
    report("arrival onto empty ledgers", seconds, results)
    ledgers = [r.grants for r in results]
    held = sum(1 for r in results for g in r.grants.values() if g.state is GrantState.GRANTED)
    print(f"    granted {held:,}; queued or refused {minds - held:,}")

    seconds, results = timed_pass(ledgers, demands, capacities, 200.0)
    report("quiet re-run (nothing changed)", seconds, results)
    ledgers = [r.grants for r in results]

    # Churn: one mind in ten leaves, as many arrive one priority class above the top.
    churned = 0
    for i, ds in enumerate(demands):
        keep = [d for d in ds if rng.random() >= 0.1]
        gone = len(ds) - len(keep)
        churned += gone
        keep += [
            replace(ds[0], name=f"new-{i}-{k}", priority=4, arrival=500.0 + k, context_tokens=2048)
            for k in range(gone)
        ]
        demands[i] = keep
    seconds, results = timed_pass(ledgers, demands, capacities, 1000.0)
    report(f"churn ({churned:,} leave, {churned:,} arrive)", seconds, results)
    ledgers = [r.grants for r in results]

    released = [
        {g.mind for g in ledger.values() if g.state is GrantState.RECLAIMING} for ledger in ledgers
    ]
    seconds, results = timed_pass(ledgers, demands, capacities, 1010.0, released)
    report(f"releases reported ({sum(map(len, released)):,})", seconds, results)


def synthetic_fleet(engines: int, minds: int, rng: random.Random, duration: float) -> Scenario:
    es = tuple(
        EngineScenario(f"e{i}", rng.randint(2, 8), rng.choice([8192, 16384]), 30.0)
        for i in range(engines)
    )
    ms = tuple(
        MindScenario(
            f"m{i}",
            f"e{rng.randrange(engines)}",
            priority=rng.randint(0, 3),
            protection_window=rng.choice([60.0, 300.0]),
            context_tokens=rng.choice([4096, 8192, 32768]),
            arrive=rng.uniform(0, 1800),
            leave=rng.choice([None, rng.uniform(1800, 3600)]),
            turn_seconds=rng.uniform(5, 120),
            think_seconds=rng.uniform(1, 60),
            release_delay_seconds=rng.uniform(0, 40),
        )
        for i in range(minds)
    )
    return Scenario(es, ms, duration=duration)


def bench_simulation(sim_seconds: float, seed: int) -> None:
    print("(b) simulation, virtual events per second of wall time")
    base = load(ROOT / "examples" / "scenarios" / "mixed-priorities.yaml")
    scenarios = [
        ("examples' mixed-priorities, 1 h", base),
        (
            f"50 engines, 500 minds, {sim_seconds:g} s",
            synthetic_fleet(50, 500, random.Random(seed), sim_seconds),
        ),
    ]
    for label, scenario in scenarios:
        start = time.perf_counter()
        result = simulate(scenario)
        seconds = time.perf_counter() - start
        rate = result.events / seconds
        print(f"    {label:<34} {result.events:>9,} events in {seconds:6.2f} s = "
              f"{rate:>9,.0f} events/s, {len(result.log):,} log lines")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minds", type=int, default=50_000)
    parser.add_argument("--engines", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-seconds", type=float, default=14_400.0)
    args = parser.parse_args()
    bench_allocation(args.minds, args.engines, args.seed)
    bench_simulation(args.sim_seconds, args.seed)


if __name__ == "__main__":
    main()
