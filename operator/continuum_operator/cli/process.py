"""What the subcommands of the long-running processes share (`continuum engine`, `continuum
embed`): how one runs until stopped and what its exit code is, and how their flags name an object
and an address."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail

__all__ = ["namespaced", "on_all_addresses", "run_process"]


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
        asyncio.run(main())
    except invalid as err:
        return fail(str(err), EXIT_INVALID)
    return EXIT_OK


def namespaced(text: str) -> tuple[str, str]:
    """`NAMESPACE/NAME` as (namespace, name) (the command checked that it has a `/`)."""
    namespace, _, name = text.partition("/")
    return namespace, name


def on_all_addresses(port: int | None, address: str) -> str:
    """`--listen HOST:PORT`'s address, unless a `--port` puts it on every address."""
    return address if port is None else f"0.0.0.0:{port}"
