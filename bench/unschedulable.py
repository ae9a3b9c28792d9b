"""The Engines' loop at rest with many Engines that fit nowhere: the CPU of a pass.

    python bench/unschedulable.py [--engines 2000] [--passes 5]

Four nodes with two engines each serving, and `--engines` Engines whose node selector matches
no node (tests/unit/kube/engines/test_loop_dirty.py's world, its in-memory API server). Once every
engine has been decided, the bench times passes at rest (nothing observed, the clock 5 s on each
time, as the loop's `resync_seconds`) and, in the same run, passes that decide every engine (the
full resync, as a pass at rest was while an engine that fits nowhere was never quiet). Prints the
CPU of each (`time.process_time`, mean of `--passes`) and the engines each decided.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "operator"))

from tests.support.engine_loop import World, engine_on  # noqa: E402


def timed(w: World, passes: int, *, everything: bool) -> tuple[float, int]:
    """Mean CPU milliseconds of a pass, and how many engines the last decided."""
    decided = 0
    spent = 0.0
    for _ in range(passes):
        w.now += 5
        if everything:
            w.loop.queue.resynced_at = None  # this pass is the full resync
        before = len(w.decided)
        started = time.process_time()
        asyncio.run(w.loop.pass_once())
        spent += time.process_time() - started
        decided = len(w.decided) - before
    return spent / passes * 1000, decided


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    w = World()
    real = w.loop.decide

    def counted(key, now):  # type: ignore[no-untyped-def]
        w.decided.append(key)
        return real(key, now)

    w.loop.decide = counted  # type: ignore[method-assign]
    for i in range(args.engines):
        w.cache.observe_engine(engine_on(f"nowhere{i}", "no-such-node", i % 60), deleted=False)
    for _ in range(4):
        asyncio.run(w.loop.pass_once())
    rest, rest_n = timed(w, args.passes, everything=False)
    full, full_n = timed(w, args.passes, everything=True)
    print(f"{args.engines} Engines that fit nowhere, 8 serving, mean of {args.passes} passes:")
    print(f"  a pass at rest: {rest:.1f} ms CPU, {rest_n} engines decided")
    print(f"  a pass deciding every engine: {full:.1f} ms CPU, {full_n} engines decided")
    print(f"  ratio: {full / max(rest, 1e-6):.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
