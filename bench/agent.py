"""The node agent's cost on an idle node: CPU time and memory over N probe cycles.

    python bench/agent.py [--cycles 200] [--interval 0] [--fixture a100x8]

Each cycle is what `continuum agent` does every --interval seconds, less the API calls: capture
every backend's raw answers (NVML, psutil and cgroups, sysctl, the process scan for attribution
and MPS), make the board (core/nodeboard.py) and decide whether it changed past the thresholds
(core/board_change.py). Prints the process's CPU seconds per cycle (user + system), the CPU share
that means at the agent's default 10 s interval, wall time per cycle, and the RSS after imports,
after the cycles, and at its peak. `--fixture NAME` answers NVML from a recorded machine
(tests/fixtures/probes/NAME.json) through the fake pynvml module, so the NVML path is exercised
on a machine without a GPU; host, process scan and cgroups are always this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from continuum_operator.agent import nvml, probe  # noqa: E402
from continuum_operator.agent.run import Agent, AgentSettings  # noqa: E402
from continuum_operator.core.board_change import board_change  # noqa: E402

MiB = 2**20
DEFAULT_INTERVAL = AgentSettings(node_name="x").interval_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between cycles")
    parser.add_argument("--fixture", default=None, help="answer NVML from this recorded machine")
    args = parser.parse_args(argv)

    capture: Any = probe.capture
    source = "this machine's NVML"
    if args.fixture:
        from continuum_operator.testing.fake_nvml import FakeNvml

        raw = json.loads((ROOT / "tests/fixtures/probes" / f"{args.fixture}.json").read_text())
        source = f"NVML replayed from {args.fixture}.json"

        def capture(settings: probe.ProbeSettings, **kwargs: Any) -> Any:
            doc, timings = probe.capture(settings, nv=FakeNvml(raw["nvml"]), **kwargs)
            return doc, timings

    me = psutil.Process(os.getpid())
    agent = Agent(AgentSettings(node_name="bench"), capture=capture)
    agent.probe()  # warm: first-use imports and caches are not the steady state
    rss_start = me.memory_info().rss
    cpu_start = time.process_time()
    walls, writes, last = [], 0, None
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        status, _ = agent.probe()
        if board_change(last, status).write:
            writes += 1
            last = status
        walls.append(time.perf_counter() - t0)
        if args.interval:
            time.sleep(args.interval)
    cpu = time.process_time() - cpu_start
    rss_end = me.memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    per_cycle = cpu / args.cycles
    print(f"agent probe cycles: {args.cycles} ({source}; board mode {last and last.memory_mode})")
    print(f"processes on this machine: {len(psutil.pids())}, CPUs: {psutil.cpu_count()}")
    print(f"CPU time: {cpu:.3f} s total, {per_cycle * 1000:.2f} ms per cycle (user+system)")
    print(
        f"CPU share at the default {DEFAULT_INTERVAL:g} s interval: "
        f"{100 * per_cycle / DEFAULT_INTERVAL:.3f}% of one core"
    )
    print(
        f"wall per cycle: median {statistics.median(walls) * 1000:.2f} ms, "
        f"max {max(walls) * 1000:.2f} ms"
    )
    print(f"board writes the thresholds allowed: {writes} of {args.cycles} cycles")
    print(
        f"RSS: {rss_start / MiB:.1f} MiB after imports, {rss_end / MiB:.1f} MiB after the cycles, "
        f"peak {peak / MiB:.1f} MiB (getrusage)"
    )
    if not nvml.parse(nvml.read_raw()).available and not args.fixture:
        print("(no NVIDIA here: the NVML path ends at nvmlInit; try --fixture a100x8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
