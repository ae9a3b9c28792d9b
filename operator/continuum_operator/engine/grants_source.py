"""Where the gateway's grant table comes from: a file (local use) or the Engine's GrantLedger
(a cluster).

The gateway never grants on its own; it enforces the table the operator wrote. Two sources:

- `watch_file`: a YAML or JSON file of `{slotTokens, phase, grants}` (docs/gateway.md), read
  again whenever it changes. For running an engine by hand, and for the tests.
- `watch_ledger`: the status of the Engine's GrantLedger (`model.grant_ledger`: its grants and
  the slot size of the launch they were made for), through a watch of that one object with the
  Kubernetes client. A thin shell: `admission.table_from_ledger` reads the object. The pod's
  Role lets it read its own ledger and write none (`kube.workloads.engine_identity`).

Both call `on_table` with every new table and keep the last good one when a document cannot be
read (logged, never guessed). The Engine itself is still read for its plan and status
(`read_engine_plan`, `read_engine_status`), and `EngineStatusWriter` writes its
`status.runtime`, whose one writer is the engine runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from continuum_operator.engine.admission import (
    GrantTable,
    GrantTableError,
    parse_table,
    table_from_ledger,
)
from continuum_operator.manifests import ManifestError, yaml_documents
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.grant_ledger import GrantLedger, engine_owners

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


def custom_objects() -> Any:
    """The Kubernetes client's CustomObjectsApi, configured in-cluster where the process runs in
    a pod and from the kubeconfig elsewhere (the engine's and the lane's runtimes, `continuum
    turn`). Imported on first use: the client is large and untyped (handled as Any here)."""
    client: Any = importlib.import_module("kubernetes.client")
    config: Any = importlib.import_module("kubernetes.config")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


# The name `EngineStatusWriter` calls it by (that writer is being rewritten; kept until then).
_custom_objects = custom_objects


async def watch_ledger(
    namespace: str, name: str, on_table: Callable[[GrantTable | None], None], *, api: Any = None
) -> None:
    """Call `on_table` with the grant table of the Engine's GrantLedger (of the same name) now
    and on every change (a watch).

    The operator makes the ledger at its first grant step for the Engine, so a pod may start
    before it exists, and it is made with no status before its first write: both are a wait
    (no table, so every turn is refused), told once at INFO, not an error each second. A
    ledger deleted, or made again and not written yet, withdraws the table (`on_table(None)`):
    its grants are the operator's no longer, and are not enforced as if they were.
    """
    watch: Any = importlib.import_module("kubernetes.watch")
    objects = api or custom_objects()
    stop = threading.Event()
    ledger = f"GrantLedger {namespace}/{name}"
    tables = _Handover(ledger, on_table, asyncio.get_running_loop())

    def run() -> None:
        version = ""
        while not stop.is_set():
            try:
                if not version:
                    engine = objects.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, "engines", name
                    )
                    tables.owner = str((engine.get("metadata") or {}).get("uid") or "")
                    obj = objects.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, GrantLedger.PLURAL, name
                    )
                    version = obj["metadata"]["resourceVersion"]
                    tables.deliver(obj)
                w = watch.Watch()
                for event in w.stream(
                    objects.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    namespace,
                    GrantLedger.PLURAL,
                    field_selector=f"metadata.name={name}",
                    resource_version=version,
                    timeout_seconds=30,
                ):
                    if stop.is_set():
                        w.stop()
                        break
                    obj = event["object"]
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if event["type"] in ("ADDED", "MODIFIED"):
                        tables.deliver(obj)
                    elif event["type"] == "DELETED":
                        tables.wait(
                            f"{ledger} deleted; refusing turns until the operator writes one"
                        )
            except Exception as err:  # not made yet, a dropped watch, an expired version
                if getattr(err, "status", None) == 404 and not version:
                    tables.wait(f"no {ledger} yet; refusing turns until the operator writes one")
                else:
                    log.warning("watch of %s: %s; starting again", ledger, err)
                version = ""
                stop.wait(RETRY_SECONDS)

    await _in_daemon_thread(run, stop, f"watch-{namespace}-{name}")


class _Handover:
    """What the watch of one GrantLedger hands the gateway, from the watch's thread: each table,
    or the table withdrawn; each wait told once at INFO."""

    def __init__(
        self,
        ledger: str,
        on_table: Callable[[GrantTable | None], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.ledger = ledger
        self.on_table = on_table
        self.loop = loop
        self.owner = ""  # the Engine's uid: a ledger owned by another is not its grants
        self.told: str | None = None  # the wait last told, so each is told once
        self.holding = False  # a table delivered and not withdrawn since

    def wait(self, message: str) -> None:
        if message != self.told:
            log.info("%s", message)
            self.told = message
        if self.holding:
            self.holding = False
            self.loop.call_soon_threadsafe(self.on_table, None)

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
        self.loop.call_soon_threadsafe(self.on_table, table)


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


async def _in_daemon_thread(run: Callable[[], None], stop: threading.Event, name: str) -> None:
    """Await `run` in a thread of its own, which ends once `stop` is set (this cancelled).

    A daemon thread, not the loop's executor: a watch blocked in a read must not hold up the
    loop's shutdown; it ends at its next event or timeout once `stop` is set."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def thread() -> None:
        try:
            run()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(finish)

    threading.Thread(target=thread, name=name, daemon=True).start()
    try:
        await done
    finally:
        stop.set()


async def read_engine_plan(namespace: str, name: str, *, api: Any = None) -> dict[str, Any]:
    """The Engine's `status.plan` (the estimate its receipt is checked against); {} if none."""
    objects = api or custom_objects()
    obj = await asyncio.to_thread(
        objects.get_namespaced_custom_object, GROUP, VERSION, namespace, "engines", name
    )
    plan = (obj.get("status") or {}).get("plan")
    return plan if isinstance(plan, dict) else {}


async def read_engine_status(namespace: str, name: str, *, api: Any = None) -> dict[str, Any]:
    """The Engine's whole `status` (its plan, and the previous runtime's report); {} if none."""
    objects = api or custom_objects()
    obj = await asyncio.to_thread(
        objects.get_namespaced_custom_object, GROUP, VERSION, namespace, "engines", name
    )
    status = obj.get("status")
    return status if isinstance(status, dict) else {}


class EngineStatusWriter:
    """Writes the Engine's `status.runtime` (its one writer), only when it changed."""

    def __init__(self, namespace: str, name: str, *, api: Any = None) -> None:
        self.namespace = namespace
        self.name = name
        self.api = api or _custom_objects()
        self.last: dict[str, Any] | None = None

    async def write(self, runtime: dict[str, Any]) -> None:
        if runtime == self.last:
            return
        # A merge patch of the one field this writer owns; lists in it are replaced whole.
        body = {"status": {"runtime": runtime}}
        await asyncio.to_thread(
            self.api.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            self.namespace,
            "engines",
            self.name,
            body,
        )
        self.last = runtime
