"""Where the gateway's grant table comes from: a file (local use) or the Engine's GrantLedger
(a cluster).

The gateway never grants on its own; it enforces the table the operator wrote. Two sources:

- `watch_file`: a YAML or JSON file of `{slotTokens, phase, grants}` (docs/gateway.md), read
  again whenever it changes. For running an engine by hand, and for the tests.
- `watch_ledger`: the status of the Engine's GrantLedger (`model.grant_ledger`: its grants and
  the slot size of the launch they were made for), through a watch of that one object on the
  operator's own adapter (`kube.client.async_api`), on the event loop. A thin shell:
  `admission.table_from_ledger` reads the object. The pod's Role lets it read its own ledger
  and write none (`kube.workloads.engine_identity`).

Both call `on_table` with every new table and keep the last good one when a document cannot be
read (logged, never guessed). The Engine itself is still read for its plan and status
(`read_engine_plan`, `read_engine_status`), and `EngineStatusWriter` writes its
`status.runtime`, whose one writer is the engine runtime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from continuum_operator.engine.admission import (
    GrantTable,
    GrantTableError,
    parse_table,
    table_from_ledger,
)
from continuum_operator.kube.client.api import crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi, follow
from continuum_operator.manifests import ManifestError, yaml_documents
from continuum_operator.model.grant_ledger import GrantLedger, engine_owners
from continuum_operator.model.json_body import text

__all__ = [
    "EngineStatusWriter",
    "read_engine_plan",
    "read_engine_status",
    "read_table_file",
    "watch_file",
    "watch_ledger",
]

log = logging.getLogger(__name__)
#: Seconds between reads of a GrantLedger not made yet, and after a dropped watch.
RETRY_SECONDS = 1.0


def read_table_file(path: Path) -> GrantTable:
    try:
        # JSON is YAML: one bounded reader for both (UTF-8, no aliases, nesting bounded).
        docs = yaml_documents(path)
    except ManifestError as err:
        raise GrantTableError(str(err)) from err
    if len(docs) > 1:
        raise GrantTableError(f"{path}: one grant table per file, found {len(docs)} documents")
    return parse_table(docs[0] if docs else None, where=str(path))


async def watch_file(
    path: Path, on_table: Callable[[GrantTable], None], *, poll_seconds: float = 0.2
) -> None:
    """Call `on_table` with the file's table now and whenever its content changes."""
    last: bytes | None = None
    while True:
        try:
            raw = path.read_bytes()
        except OSError as err:
            raw = None
            if last is not None:
                log.warning("grant table %s unreadable (%s); keeping the last one", path, err)
                last = b""
        if raw is not None and raw != last:
            last = raw
            try:
                table = read_table_file(path)
            except GrantTableError as err:
                log.error("%s; keeping the last good grant table", err)
            else:
                on_table(table)
        await asyncio.sleep(poll_seconds)


async def watch_ledger(
    namespace: str, name: str, on_table: Callable[[GrantTable | None], None], *, api: AsyncKubeApi
) -> None:
    """Call `on_table` with the grant table of the Engine's GrantLedger (of the same name) now
    and on every change: the ledger followed (`kube.client.async_api.follow`: listed by name, then
    watched from there, resumed where a stream ended, listed again after a 410).

    The operator makes the ledger at its first grant step for the Engine, so a pod may start
    before it exists, and it is made with no status before its first write: both are a wait
    (no table, so every turn is refused), told once at INFO, not an error each second. A
    ledger deleted, or made again and not written yet, withdraws the table (`on_table(None)`):
    its grants are the operator's no longer, and are not enforced as if they were.
    """
    ledger = f"GrantLedger {namespace}/{name}"
    tables = _Handover(ledger, on_table)

    async def listed(items: AsyncIterator[dict[str, Any]]) -> None:
        # The Engine's uid at each list: a ledger owned by another is not its grants.
        engine = await api.request("GET", crd_path("engines", namespace, name))
        tables.owner = text(engine, "metadata", "uid") or ""
        if (ledger_body := await anext(items, None)) is not None:
            tables.deliver(ledger_body)
        else:
            tables.wait(f"no {ledger} yet; refusing turns until the operator writes one")

    def changed(event: dict[str, Any]) -> None:
        if event.get("type") == "DELETED":
            tables.wait(f"{ledger} deleted; refusing turns until the operator writes one")
        else:
            tables.deliver(event.get("object") or {})

    await follow(
        api,
        crd_path(GrantLedger.PLURAL, namespace),
        [("fieldSelector", f"metadata.name={name}")],
        listed,
        changed,
        what=ledger,
        retry_seconds=RETRY_SECONDS,
    )


class _Handover:
    """What the watch of one GrantLedger hands the gateway: each table, or the table
    withdrawn; each wait told once at INFO."""

    def __init__(self, ledger: str, on_table: Callable[[GrantTable | None], None]) -> None:
        self.ledger = ledger
        self.on_table = on_table
        self.owner = ""  # the Engine's uid: a ledger owned by another is not its grants
        self.told: str | None = None  # the wait last told, so each is told once
        self.holding = False  # a table delivered and not withdrawn since

    def wait(self, message: str) -> None:
        if message != self.told:
            log.info("%s", message)
            self.told = message
        if self.holding:
            self.holding = False
            self.on_table(None)

    def deliver(self, obj: dict[str, Any]) -> None:
        waiting = _not_yet_a_table(obj, self.owner, self.ledger)
        if waiting is not None:
            self.wait(waiting)
            return
        try:
            table = table_from_ledger(obj)
        except GrantTableError as err:
            log.error("%s; keeping the last good grant table", err)
            return
        self.told = None
        self.holding = True
        self.on_table(table)


def _not_yet_a_table(obj: dict[str, Any], owner: str, ledger: str) -> str | None:
    """Why a GrantLedger object gives no table yet, in words (None: it gives one)."""
    if owner and owner not in engine_owners(obj):
        # Left by an earlier Engine of this name (deleted and made again before the garbage
        # collector took its ledger): not this Engine's grants. The operator replaces it.
        return (
            f"{ledger} belongs to an earlier Engine of that name; refusing turns until the "
            "operator replaces it"
        )
    if not obj.get("status"):
        return f"{ledger} made, its status not written yet; refusing turns until it is"
    return None


async def read_engine_plan(namespace: str, name: str, *, api: AsyncKubeApi) -> dict[str, Any]:
    """The Engine's `status.plan` (the estimate its receipt is checked against); {} if none."""
    plan = (await read_engine_status(namespace, name, api=api)).get("plan")
    return plan if isinstance(plan, dict) else {}


async def read_engine_status(namespace: str, name: str, *, api: AsyncKubeApi) -> dict[str, Any]:
    """The Engine's whole `status` (its plan, and the previous runtime's report); {} if none."""
    obj = await api.request("GET", crd_path("engines", namespace, name))
    status = obj.get("status")
    return status if isinstance(status, dict) else {}


class EngineStatusWriter:
    """Writes the Engine's `status.runtime` (its one writer), only when it changed."""

    def __init__(self, namespace: str, name: str, *, api: AsyncKubeApi) -> None:
        self.path = crd_path("engines", namespace, name, sub="status")
        self.api = api
        self.last: dict[str, Any] | None = None

    async def write(self, runtime: dict[str, Any]) -> None:
        if runtime == self.last:
            return
        # A merge patch of the one field this writer owns; lists in it are replaced whole.
        await self.api.merge_patch(self.path, {"status": {"runtime": runtime}})
        self.last = runtime
