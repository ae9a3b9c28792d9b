"""An executor that refuses every job: a test that runs on it shows its code takes no thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class NoThreads(ThreadPoolExecutor):
    """An executor that runs nothing (a loop's default executor must be a thread pool): each
    job asked of it is counted and refused."""

    def __init__(self) -> None:
        super().__init__(1)
        self.asked: list[str] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.asked.append(getattr(fn, "__qualname__", repr(fn)))
        raise RuntimeError("no thread here")
