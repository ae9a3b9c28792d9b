"""`continuum run --class background -- CMD...`: a mind's own work, below the engine serving her.

docs/design.md rule 8: processes a mind spawns inside its pod run at the OS's lowest ordinary
priority, so they never starve the engine yet still use every idle core: nice 19 on Unix,
IDLE_PRIORITY_CLASS on Windows, and elsewhere the parent's class (nothing to lower to that
psutil knows). Mind runtimes run every child through it; the children's webhook
(`kube.children.webhook`) marks a mind's child pods with `CONTINUUM_PROCESS_CLASS=background`, which
is this command's default class when no `--class` is given.

How all descendants are reached: the runner lowers itself before it starts CMD, so CMD and
everything CMD starts inherit the class (Unix nice values and Windows' idle class are both
inherited). Then, while CMD runs, it sweeps CMD's descendants every `--sweep` seconds and lowers
any that runs above the class (a program that raised its own priority with the privilege to do
so), and on Linux any that started a session of its own, whose autogroup it lowers to nice 19
as well (with autogroups, nice ranks a process only among its own session's). Signals it
receives (TERM, INT, HUP) are passed to CMD; its exit status is CMD's.

Outside the pure core: it uses psutil. Neighbours: `cli` (registers `run`), `kube.children.webhook`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

__all__ = ["ENV", "ProcessClass", "lower", "lowest_priority", "run"]

ENV = "CONTINUUM_PROCESS_CLASS"
UNIX_LOWEST = 19


class ProcessClass(StrEnum):
    NORMAL = "normal"
    """As the parent runs: nothing changed."""
    BACKGROUND = "background"
    """The OS's lowest ordinary priority, for CMD and every descendant."""


def lowest_priority() -> int | None:
    """The value for `psutil.Process.nice` that is this OS's lowest ordinary priority.

    None where psutil knows of none: the parent's class is kept.
    """
    if psutil.WINDOWS:
        return int(getattr(psutil, "IDLE_PRIORITY_CLASS"))  # noqa: B009 (Windows only)
    if psutil.POSIX:
        return UNIX_LOWEST
    return None


def _above(current: int, lowest: int) -> bool:
    """Whether a process at `current` runs above `lowest` (Windows classes are not ordered)."""
    return current != lowest if psutil.WINDOWS else current < lowest


def lower(process: psutil.Process, lowest: int) -> bool:
    """Lowers one process to `lowest` if it runs above it; True if it was changed."""
    changed = False
    try:
        if _above(int(process.nice()), lowest):
            process.nice(lowest)
            changed = True
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass  # gone, or not ours to change: the next sweep sees it again if it still runs
    return _lower_autogroup(process.pid, lowest) or changed


def _lower_autogroup(pid: int, lowest: int) -> bool:
    """Linux's autogroups: a descendant that started a session of its own (setsid) runs in a
    new autogroup, where its nice ranks it only inside that session while the group competes
    with the engine's at the group's own nice (0). That group's nice is lowered too."""
    if not sys.platform.startswith("linux") or os.getsid(0) == _sid(pid):
        return False
    path = Path(f"/proc/{pid}/autogroup")
    try:
        if int(path.read_text().split()[-1]) >= lowest:  # "/autogroup-123 nice 0"
            return False
        path.write_text(str(lowest))
    except (OSError, ValueError, IndexError):
        return False  # no autogroups here, or the process is gone
    return True


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def sweep(root: psutil.Process, lowest: int) -> int:
    """Lowers every descendant of `root` that runs above `lowest`; how many were changed."""
    try:
        descendants = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0
    return sum(lower(p, lowest) for p in descendants)


def run(cmd: Sequence[str], cls: ProcessClass, sweep_seconds: float = 2.0) -> int:
    """Runs `cmd` in `cls` until it exits; its exit status (128+N when killed by signal N)."""
    lowest = lowest_priority() if cls is ProcessClass.BACKGROUND else None
    if cls is ProcessClass.BACKGROUND and lowest is None:
        print(
            f"continuum run: {sys.platform} has no lower priority psutil can set; "
            "running at the parent's class",
            file=sys.stderr,
        )
    me = psutil.Process()
    if lowest is not None:
        lower(me, lowest)  # before the child starts: it and its descendants inherit the class
    env = {**os.environ, ENV: str(cls)}
    try:
        child = subprocess.Popen(list(cmd), env=env)
    except OSError as err:
        print(f"continuum run: cannot start {cmd[0]}: {err}", file=sys.stderr)
        return 127
    forwarded = _forward_signals(child)
    try:
        root = psutil.Process(child.pid)
        while True:
            if lowest is not None:
                lower(root, lowest)
                sweep(root, lowest)
            try:
                code = child.wait(timeout=sweep_seconds)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        for sig, previous in forwarded.items():
            signal.signal(sig, previous)
    return 128 - code if code < 0 else code


def _forward_signals(child: subprocess.Popen[bytes]) -> dict[int, Any]:
    def forward(sig: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    previous: dict[int, Any] = {}
    names = ("SIGTERM", "SIGINT", "SIGHUP") if os.name == "posix" else ("SIGTERM", "SIGINT")
    for name in names:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, forward)
    return previous


def default_class() -> str:
    value = os.environ.get(ENV, "")
    return value if value in {str(c) for c in ProcessClass} else str(ProcessClass.NORMAL)
