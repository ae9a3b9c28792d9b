"""What the subcommands of the long-running processes share (`continuum engine`, `continuum
embed`): how one runs until stopped and what its exit code is, on which event loop, and how their
flags name an object and an address."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail

__all__ = ["namespaced", "on_all_addresses", "run_process"]

log = logging.getLogger(__name__)


def run_process(
    refusal: str | None,
    main: Callable[[], Coroutine[Any, Any, None]],
    invalid: tuple[type[Exception], ...],
) -> int:
    """Run a process until it stops (0): refused with exit 2 and `refusal` (what is wrong with
    its command line and what to give) before it starts, or with exit 2 and the error's message
    when it raises one of `invalid` (a file or a cluster it cannot use)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if refusal is not None:
        return fail(refusal, EXIT_INVALID)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(main())
    except invalid as err:
        return fail(str(err), EXIT_INVALID)
    return EXIT_OK


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop (libuv's, in C): the loop's own work per request of the gateway, in
    Python on asyncio's, is what it takes off (docs/gateway.md, "What the gateway costs").
    asyncio's (None, `asyncio.Runner`'s own) only where uvloop cannot be imported (a platform
    it has no build for). Which one runs is logged."""
    try:
        import uvloop
    except ImportError as err:
        log.info("event loop: asyncio's (uvloop cannot be imported: %s)", err)
        return None
    log.info("event loop: uvloop's")
    return uvloop.new_event_loop


def namespaced(text: str) -> tuple[str, str]:
    """`NAMESPACE/NAME` as (namespace, name) (the command checked that it has a `/`)."""
    namespace, _, name = text.partition("/")
    return namespace, name


def on_all_addresses(port: int | None, address: str) -> str:
    """`--listen HOST:PORT`'s address, unless a `--port` puts it on every address."""
    return address if port is None else f"0.0.0.0:{port}"
