"""A sampling profiler of every thread, for a process a bench starts (py-spy is not at hand).

    python bench/sampler.py OUT.txt -m continuum_operator.cli operator ...

Runs the module as `python -m` would, and every `--interval` reads every thread's stack
(`sys._current_frames`). Samples whose innermost frame waits (a lock, a socket, a selector) are
counted as idle. At exit, OUT.txt gets the functions seen most in busy samples: inclusive (on
the stack) and self (innermost). cProfile sees only the main thread; the operator decides in
worker threads too.
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import sys
import threading
import time
from types import FrameType

_IDLE = frozenset(
    {"wait", "select", "acquire", "sleep", "poll", "readinto", "recv_into", "recv", "_worker",
     "get", "accept", "read", "_wait_for_tstate_lock", "serve_forever", "epoll"}
)  # fmt: skip


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


def main() -> None:
    out, interval = sys.argv[1], float(os.environ.get("SAMPLER_INTERVAL", "0.01"))
    if sys.argv[2] != "-m":
        raise SystemExit("usage: sampler.py OUT.txt -m MODULE [ARGS...]")
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    counts = {"busy": 0, "idle": 0}
    me = threading.get_ident()

    def sample() -> None:
        while True:
            time.sleep(interval)
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if frame.f_code.co_name in _IDLE:
                    counts["idle"] += 1
                    continue
                counts["busy"] += 1
                own[_where(frame)] += 1
                seen: set[str] = set()
                f: FrameType | None = frame
                while f is not None:
                    seen.add(_where(f))
                    f = f.f_back
                inclusive.update(seen)

    def dump() -> None:
        busy = counts["busy"] or 1
        with open(out, "w") as fh:
            fh.write(f"samples: {counts['busy']} busy, {counts['idle']} idle, every {interval}s\n")
            fh.write("\ninclusive (share of busy samples with the function on the stack)\n")
            for name, n in inclusive.most_common(60):
                fh.write(f"{100 * n / busy:6.1f}%  {name}\n")
            fh.write("\nself (innermost frame)\n")
            for name, n in own.most_common(40):
                fh.write(f"{100 * n / busy:6.1f}%  {name}\n")

    atexit.register(dump)
    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    sampler.start()
    me = sampler.ident or me
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
