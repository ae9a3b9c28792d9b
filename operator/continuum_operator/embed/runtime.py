"""`continuum embed`: serve embeddings for one EmbedLane, within its lease, and report them.

The process of an embed lane. Before the first request it calibrates: a pass at the largest
context the lane has embedded (from its `status.runtime` when it ran before; one context step
for a new lane), so the floor the operator keeps is allocated and measured. Then
`POST /v1/embeddings` (OpenAI's shape: `input` a string or a list) is admitted against the
lane's lease (`core.embed.admit`): it fits (served), waits (for up to `waitSeconds` for the
operator to grow the lease, then 503) or fails (413: larger than spec.maxContextTokens). Its
context grows only to what the lease holds, so it never over-commits its pool.

The door (docs/embedlanes.md, "The door"): each `POST /v1/embeddings` carries a bearer token
(the OpenAI client's API key), reviewed with the API server for the lane's own audience
(`door.accounts.lane_audience`, not an engine's) by `door.token_review.TokenReviewer`, as the
engine's gateway reviews minds' tokens; a service account of the lane's namespace is served,
one of another namespace refused (403), no
token or one not issued for that audience refused (401), all in OpenAI's error shape. On with
`--lane NS/NAME`; `--unsafe-no-review` opens the port to anyone (a machine of one's own). A
caller let in has her body read under `LANE_BODY_LIMITS` (`door.body_limits`, as the gateway reads
its bodies): 408 past its time, 413 past its size, 503 past the budget of bodies read at once.

It is the one writer of the lane's `status.runtime` (docs/design.md "One writer per status field"):
the largest context embedded, the context held, whether llama.cpp can offload to a GPU, the
receipts of its loads, and counts of requests served, waited and refused; to a file, to the
EmbedLane, or both, only when it changed. On the admin address only (`--admin-port`, as the
engine's): `GET /v1/runtime` answers the same document, `GET /metrics` the same counts as
Prometheus metrics (`embed.metrics`), current at each scrape.

The lease comes from the EmbedLane (`--lane NAMESPACE/NAME`, watched) or a file holding an
EmbedLane or its `status.placement` (`--lane-file`, re-read when it changes).
Neighbours: `embed.lane` (llama-cpp-python), `core.embed` (admission), `kube.lanes.loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from continuum_operator.core.embed import LaneVerdict, admit
from continuum_operator.core.receipts import Receipt
from continuum_operator.door.accounts import (
    REVIEW_RETRY_SECONDS,
    ReviewUnavailable,
    ServiceAccount,
    review_unavailable_message,
)
from continuum_operator.door.body_limits import BodyLimits, BodyReader, BodyRefused
from continuum_operator.door.openai_errors import error_body, error_type
from continuum_operator.door.serving import admin_application, serve_app
from continuum_operator.door.token_review import Caller, TokenReviewer, caller_of
from continuum_operator.embed.lane import LaneModel, gpu_offload_supported, llama_build
from continuum_operator.embed.metrics import CONTENT_TYPE_LATEST, LaneMetrics
from continuum_operator.kube.client.api import crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi, follow
from continuum_operator.manifests import ManifestError, yaml_documents

__all__ = [
    "LANE_BODY_LIMITS",
    "Callers",
    "Door",
    "LanePhase",
    "LaneProcessSettings",
    "LaneRuntime",
    "LaneState",
    "lane_state_from",
    "refuse_caller",
    "serve",
]

log = logging.getLogger(__name__)

#: Receipts kept in status: the largest contexts loaded (the operator scales from them).
RECEIPTS_KEPT = 4

#: How a caller's body is read (`door.body_limits`): whole within 10 s, as the gateway's; at most
#: 1 MiB, what aiohttp's `request.json()` read before (about 250,000 tokens of text, above any
#: lane's batch of inputs); 16 MiB of bodies at once, a lane embedding one request at a time.
LANE_BODY_LIMITS = BodyLimits(seconds=10.0, max_bytes=2**20, budget_bytes=16 * 2**20)

#: The lane's reason for a body it would not read, by status (its error shape's `reason`).
_BODY_REASONS = {400: "BadRequest", 408: "BodyTimeout", 413: "BodyTooLarge", 503: "BodiesBusy"}

Publish = Callable[[dict[str, Any]], Awaitable[None]]
#: Reviews a bearer token: the service account it belongs to, or None (`TokenReviewer`).
Review = Callable[[str, Caller], Awaitable[ServiceAccount | None]]


class LanePhase(StrEnum):
    """Where an EmbedLane's runtime is (the engine's is `engine.runtime.RuntimePhase`)."""

    CALIBRATING = "Calibrating"
    SERVING = "Serving"


@dataclass(frozen=True, slots=True)
class LaneState:
    """What the runtime reads of its EmbedLane: the maximum, the lease, what it embedded."""

    max_context_tokens: int
    leased_context_tokens: int = 0
    residence: str | None = None
    largest_embedded_tokens: int = 0


def lane_state_from(doc: dict[str, Any], max_context_tokens: int | None = None) -> LaneState:
    """From an EmbedLane object, or a bare placement document (with `max_context_tokens`).
    A document of the wrong shape is a ValueError saying so (the lane file is anyone's)."""
    try:
        return _lane_state(doc, max_context_tokens)
    except (AttributeError, TypeError) as err:
        raise ValueError(
            f"not an EmbedLane nor a placement document ({type(err).__name__}: {err}); give "
            "`kubectl get embedlane NAME -o yaml` or its status.placement"
        ) from err


def _lane_state(doc: dict[str, Any], max_context_tokens: int | None) -> LaneState:
    if "spec" in doc or "status" in doc:
        spec = doc.get("spec") or {}
        status = doc.get("status") or {}
        placement = status.get("placement") or {}
        runtime = status.get("runtime") or {}
        max_ctx = int(spec.get("maxContextTokens") or max_context_tokens or 0)
        largest = int(runtime.get("largestContextTokens") or 0)
    else:
        placement, max_ctx, largest = doc, int(max_context_tokens or 0), 0
    if max_ctx <= 0:
        raise ValueError("no maxContextTokens: give an EmbedLane, or --max-context-tokens")
    fits = placement.get("verdict") == str(LaneVerdict.FITS)
    leased = int(placement.get("contextTokens") or 0) if fits else 0
    return LaneState(
        max_context_tokens=max_ctx,
        leased_context_tokens=leased,
        residence=placement.get("residence"),
        # As the operator counts it (`kube.lanes.lane_pass`): what was embedded holds within the
        # lease; a pod on another node (a smaller one) calibrates within its own, not at the
        # largest context its predecessor embedded, which that node may never lease.
        largest_embedded_tokens=max(min(largest, leased), int(placement.get("floorTokens") or 0)),
    )


@dataclass(frozen=True, slots=True)
class Door:
    """Who may call `POST /v1/embeddings`: a bearer token the API server accepts for
    `audience`, of a service account of `namespace` (the lane's own: an EmbedLane has no
    allow-list, so its namespace is the boundary)."""

    review: Review
    audience: str
    namespace: str


def refuse_caller(
    account: ServiceAccount | None, *, sent: bool, audience: str, namespace: str
) -> tuple[int, dict[str, Any]] | None:
    """The refusal of a caller (status, OpenAI-shaped body), or None: served. `account` is
    what the review of her token said (None: not accepted); `sent`: whether she sent one."""
    how = (
        f"send a token of a service account of namespace {namespace}, projected with the "
        f"audience {audience}, as Authorization: Bearer (the OpenAI client's API key)"
    )
    if account is None:
        if not sent:
            return 401, _error(401, "Unauthenticated", f"no bearer token: {how}")
        why = (
            "the API server did not accept the token for this lane's audience (expired, "
            "forged, made for another audience such as an engine's or the API server's, or "
            "not a service account's)"
        )
        return 401, _error(401, "Unauthenticated", f"{why}: {how}")
    if account.namespace != namespace:
        return 403, _error(
            403,
            "Forbidden",
            f"service account {account.namespace}/{account.name} is of namespace "
            f"{account.namespace}; this lane serves only service accounts of namespace "
            f"{namespace}: call it from a pod of {namespace}",
        )
    return None


@dataclass
class Counts:
    served: int = 0
    waited: int = 0
    refused: int = 0
    last_refusal: dict[str, Any] | None = None


@dataclass
class LaneRuntime:
    model: LaneModel
    state: LaneState
    publish: Publish | None = None
    #: Who may call; None: anyone who reaches the port (`--unsafe-no-review` only).
    door: Door | None = None
    clock: Callable[[], float] = time.monotonic
    phase: LanePhase = LanePhase.CALIBRATING
    largest: int = 0
    receipts: dict[int, Receipt] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    metrics: LaneMetrics = field(default_factory=LaneMetrics)
    bodies: BodyReader = field(default_factory=lambda: BodyReader(LANE_BODY_LIMITS))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _lease_changed: asyncio.Event = field(default_factory=asyncio.Event)
    _last_published: dict[str, Any] | None = None
    _published_at: float = float("-inf")
    #: Request counts alone are written at most this often (seconds): every write is a watch
    #: event for the operator. What the lease depends on (context, receipts) is written at once.
    counts_interval: float = 10.0

    def __post_init__(self) -> None:
        self.largest = self.state.largest_embedded_tokens
        self.metrics.set_context(self.largest, self.model.cells)
        self.metrics.set_leased(self.state.leased_context_tokens)

    # -- status.runtime ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        kept = sorted(self.receipts.items())[-RECEIPTS_KEPT:]
        return {
            "phase": self.phase.value,
            "ready": self.phase is LanePhase.SERVING,
            "gpuOffload": gpu_offload_supported(),
            "llamaBuild": llama_build(),
            "maxContextTokens": self.state.max_context_tokens,
            "leasedContextTokens": self.state.leased_context_tokens,
            "contextTokens": self.model.cells,
            "largestContextTokens": self.largest,
            "receipts": [r.model_dump(mode="json", by_alias=True) for _, r in kept],
            "requests": {
                "served": self.counts.served,
                "waited": self.counts.waited,
                "refused": self.counts.refused,
            },
            "lastRefusal": self.counts.last_refusal,
        }

    async def publish_status(self, *, flush: bool = False) -> None:
        """Write status.runtime if it changed: at once when more than the counts changed, else
        at most every `counts_interval` (or on `flush`)."""
        doc = self.status()
        last = self._last_published
        if self.publish is None or doc == last:
            return
        counts_only = last is not None and _without_counts(doc) == _without_counts(last)
        if counts_only and not flush and self.clock() - self._published_at < self.counts_interval:
            return
        try:
            await self.publish(doc)
            self._last_published = doc
            self._published_at = self.clock()
        except Exception as err:  # retried on the next change
            log.warning("could not write status.runtime: %s", err)

    async def flush_loop(self) -> None:
        """Writes counts that changed since the last write, every `counts_interval`."""
        while True:
            await asyncio.sleep(self.counts_interval)
            await self.publish_status(flush=True)

    def set_state(self, state: LaneState) -> None:
        """A new lease (or maximum) from the EmbedLane; waiting requests look again."""
        if state != self.state:
            self.state = state
            self.metrics.set_leased(state.leased_context_tokens)
            self._lease_changed.set()

    # -- calibration ------------------------------------------------------------------------

    async def calibrate(self) -> None:
        """The pass at the lane's largest context, before the first request (sets the floor).

        It waits until the lease holds that context: nothing is allocated before the operator
        has placed the lane (a new lane is placed on the estimate).
        """
        target = min(max(1, self.largest), self.state.max_context_tokens)
        while self.state.leased_context_tokens < target:
            log.info("waiting for a lease of %d tokens to calibrate", target)
            self._lease_changed.clear()
            await self._lease_changed.wait()
            target = min(max(1, self.largest), self.state.max_context_tokens)
        async with self._lock:
            loaded = await asyncio.to_thread(self.model.calibrate, target)
        if loaded is not None and loaded.receipt is not None:
            self.receipts[loaded.cells] = loaded.receipt
        self.largest = max(self.largest, target)
        self.metrics.set_context(self.largest, self.model.cells)
        self.phase = LanePhase.SERVING
        await self.publish_status()

    # -- requests ---------------------------------------------------------------------------

    async def embed(
        self, texts: list[str], wait_seconds: float = 0.0
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of one embedding request."""
        if self.phase is not LanePhase.SERVING:
            self.metrics.refused("Calibrating")
            return 503, _error(503, "Calibrating", "the lane is calibrating; try again shortly")
        async with self._lock:
            counts = await asyncio.to_thread(self.model.count_tokens, texts)
        deadline = self.clock() + max(0.0, wait_seconds)
        waited = False
        while True:
            a = admit(
                counts,
                max_context_tokens=self.state.max_context_tokens,
                leased_context_tokens=self.state.leased_context_tokens,
            )
            if a.verdict is LaneVerdict.FITS:
                break
            left = deadline - self.clock()
            if a.verdict is LaneVerdict.FAILS or left <= 0:
                self.counts.refused += 1
                self.metrics.refused(str(a.reason))
                self.counts.last_refusal = {
                    "reason": str(a.reason),
                    "message": a.message,
                    "tokens": a.tokens,
                }
                await self.publish_status()
                status = 413 if a.verdict is LaneVerdict.FAILS else 503
                return status, _error(status, str(a.reason), a.message, a.tokens)
            if not waited:
                waited = True
                self.counts.waited += 1
                self.metrics.waited_request()
            self._lease_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lease_changed.wait(), left)
        async with self._lock:
            loaded = await asyncio.to_thread(self.model.ensure, a.tokens)
            vectors = await asyncio.to_thread(self.model.embed, texts)
        if loaded is not None and loaded.receipt is not None:
            self.receipts[loaded.cells] = loaded.receipt
        self.largest = max(self.largest, a.tokens)
        self.counts.served += 1
        total = sum(counts)
        self.metrics.served_request(len(texts), total, self.largest, self.model.cells)
        await self.publish_status()
        return 200, {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
            ],
            "model": self.model.model.name,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }

    # -- HTTP -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The lane's door: `POST /v1/embeddings`, and the probes where the kubelet reads them."""
        app = web.Application()
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    def admin_app(self) -> web.Application:
        """What is served to the cluster's operators, never to callers, on a port of its own
        (as the engine's `Gateway.admin_app`): `/metrics`, `/v1/runtime`, and the probes."""
        return admin_application(
            self._metrics, self._healthz, self._readyz, {"/v1/runtime": self._runtime}
        )

    def _of_namespace(self, account: ServiceAccount) -> bool:
        """Whether an account is of the lane's namespace (its callers': a lane, not access)."""
        return self.door is not None and account.namespace == self.door.namespace

    async def _refused(self, request: web.Request) -> web.Response | None:
        """The answer to a caller the door does not let in, or None."""
        if self.door is None:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        sent = scheme.lower() == "bearer" and bool(token)
        try:
            # Her namespace's tokens wait in a lane of their own (door.token_review).
            caller = caller_of(token, request.remote or "", self._of_namespace)
            account = await self.door.review(token, caller) if sent else None
        except ReviewUnavailable as err:  # not judged: her client may send it again
            # The engine gateway's words and wait.
            doc = _error(503, "ReviewUnavailable", review_unavailable_message(str(err)))
            headers = {"Retry-After": str(REVIEW_RETRY_SECONDS)}
            return web.json_response(doc, status=503, headers=headers)
        refusal = refuse_caller(
            account, sent=sent, audience=self.door.audience, namespace=self.door.namespace
        )
        if refusal is None:
            return None
        status, doc = refusal
        return web.json_response(doc, status=status)

    async def _embeddings(self, request: web.Request) -> web.Response:
        refused = await self._refused(request)  # before the body is read
        if refused is not None:
            return refused
        body = await self.bodies.read_json(request)
        if isinstance(body, BodyRefused):
            return _body_refused(body)
        raw = body.get("input") if isinstance(body, dict) else None
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            message = "`input` must be a string or a non-empty list of strings"
            return web.json_response(_error(400, "BadRequest", message), status=400)
        try:
            wait = float(body.get("waitSeconds", 0.0))
        except (TypeError, ValueError):
            return web.json_response(
                _error(400, "BadRequest", "`waitSeconds` must be a number"), status=400
            )
        status, doc = await self.embed(texts, wait)
        return web.json_response(doc, status=status)

    async def _runtime(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = self.phase is LanePhase.SERVING
        return web.json_response({"ready": ready}, status=200 if ready else 503)


def _body_refused(refused: BodyRefused) -> web.Response:
    """A body the lane would not read, in its error shape; the connection is closed where the
    body was left unread (past its time or size)."""
    reason = _BODY_REASONS.get(refused.status, "BadRequest")
    headers = {} if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
    answer = web.json_response(
        _error(refused.status, reason, refused.message), status=refused.status, headers=headers
    )
    if refused.close:
        answer.force_close()
    return answer


def _without_counts(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("requests", "lastRefusal")}


def _error(status: int, reason: str, message: str, tokens: int = 0) -> dict[str, Any]:
    """OpenAI's error shape (its clients read `message`, `type`, `code`), with the lane's own
    `reason` and `tokens` beside them; `code` is the reason in snake case, as the engine's."""
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", reason).lower()
    body = error_body(message, error_type(status), code)
    body["error"].update(reason=reason, tokens=tokens)
    return body


# --- where the lease comes from, where status goes ---------------------------------------------


def read_lane_file(path: Path, max_context_tokens: int | None) -> LaneState:
    try:
        docs = yaml_documents(path)
    except ManifestError as err:
        raise ValueError(str(err)) from err
    doc = docs[0] if len(docs) == 1 else None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not an EmbedLane or a placement (a mapping)")
    return lane_state_from(doc, max_context_tokens)


async def watch_lane_file(
    path: Path,
    max_context_tokens: int | None,
    on_state: Callable[[LaneState], None],
    *,
    poll_seconds: float = 0.2,
) -> None:
    last: bytes | None = None
    while True:
        try:
            raw = path.read_bytes()
        except OSError:
            raw = None
        if raw is not None and raw != last:
            last = raw
            try:
                on_state(read_lane_file(path, max_context_tokens))
            except (ValueError, yaml.YAMLError) as err:
                log.error("%s; keeping the last lease", err)
        await asyncio.sleep(poll_seconds)


class LaneObject:
    """The EmbedLane in the API: read and followed for its lease, patched for
    `status.runtime` only, on the process's adapter (`kube.client.async_api`)."""

    def __init__(self, namespace: str, name: str, *, api: AsyncKubeApi) -> None:
        self.namespace, self.name = namespace, name
        self.api = api

    async def read(self) -> dict[str, Any]:
        return await self.api.request("GET", crd_path("embedlanes", self.namespace, self.name))

    async def write(self, runtime: dict[str, Any]) -> None:
        path = crd_path("embedlanes", self.namespace, self.name, sub="status")
        await self.api.merge_patch(path, {"status": {"runtime": runtime}})

    async def watch(self, on_state: Callable[[LaneState], None]) -> None:
        """`on_state` with the lane's lease now and at each change of the lane: a watch of
        the one object (`follow`: resumed where a stream ended, listed again after a 410),
        not a read every few seconds. A lane gone, or one whose lease cannot be read, keeps
        the last lease (logged) until the next change."""
        lane = f"EmbedLane {self.namespace}/{self.name}"

        def seen(obj: dict[str, Any]) -> None:
            try:
                on_state(lane_state_from(obj))
            except ValueError as err:
                log.warning("%s: %s; keeping the last lease", lane, err)

        async def listed(items: AsyncIterator[dict[str, Any]]) -> None:
            if (obj := await anext(items, None)) is not None:
                seen(obj)
            else:
                log.warning("%s not found; keeping the last lease", lane)

        def changed(event: dict[str, Any]) -> None:
            if event.get("type") == "DELETED":
                log.warning("%s deleted; keeping the last lease", lane)
            else:
                seen(event.get("object") or {})

        await follow(
            self.api,
            crd_path("embedlanes", self.namespace),
            [("fieldSelector", f"metadata.name={self.name}")],
            listed,
            changed,
            what=lane,
        )


def _file_publisher(path: Path) -> Publish:
    async def publish(doc: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
        os.replace(tmp, path)

    return publish


# --- the command -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Callers:
    """Who a lane serves: service accounts of `namespace` whose tokens the API server accepts
    for `audience`."""

    audience: str
    namespace: str


@dataclass(frozen=True, slots=True)
class LaneProcessSettings:
    """What one `continuum embed` process runs, read from its command line by `cli.embed`
    (which says each flag's default): the model, where its lease comes from, where its runtime
    document goes, who may call, and the addresses it serves."""

    model: Path
    model_sha256: str | None
    """The model's digest; None: the file is hashed."""
    lane: tuple[str, str] | None
    """(namespace, name) of the EmbedLane, followed for its lease; None: `lane_file`."""
    lane_file: Path | None
    """An EmbedLane or placement file, watched; None: `lane`."""
    max_context_tokens: int | None
    """The lane's maximum when `lane_file` is a bare placement."""
    listen: str
    admin_listen: str
    callers: Callers | None
    """Whose tokens are served; None: anyone who reaches `listen` (`--unsafe-no-review`)."""
    status_file: Path | None
    threads: int


async def serve(settings: LaneProcessSettings) -> None:
    """Run the lane until SIGTERM or SIGINT. Raises ValueError or OSError for a lane file or
    lane it cannot use, `ConnectionError` (an OSError) when there is no API server."""
    # One adapter for every API call of the process, on its loop (the lane's watch and status,
    # the callers' TokenReviews); with a lane file the reviewer connects its own at its first
    # review, so a machine with no cluster runs without one.
    if settings.lane is None:
        await _serve(settings, None)
        return
    async with await AsyncKubeApi.connect() as api:
        await _serve(settings, api)


async def _serve(settings: LaneProcessSettings, api: AsyncKubeApi | None) -> None:
    lane_obj: LaneObject | None = None
    if settings.lane is not None:
        assert api is not None
        lane_obj = LaneObject(*settings.lane, api=api)
        state = lane_state_from(await lane_obj.read(), settings.max_context_tokens)
    else:
        assert settings.lane_file is not None
        state = read_lane_file(settings.lane_file, settings.max_context_tokens)
    model = await _model(settings, state)
    sinks: list[Publish] = []
    if settings.status_file is not None:
        sinks.append(_file_publisher(settings.status_file))
    if lane_obj is not None:
        sinks.append(lane_obj.write)

    async def publish(doc: dict[str, Any]) -> None:
        for sink in sinks:
            await sink(doc)

    door = _door(settings, api)
    runtime = LaneRuntime(model, state, publish=publish, door=door)
    flusher = asyncio.create_task(runtime.flush_loop())
    if lane_obj is not None:
        source = asyncio.create_task(lane_obj.watch(runtime.set_state))
    else:
        assert settings.lane_file is not None
        source = asyncio.create_task(
            watch_lane_file(settings.lane_file, settings.max_context_tokens, runtime.set_state)
        )
    runners = []
    for served, address, what in (
        (runtime.app(), settings.listen, "embed lane"),
        (runtime.admin_app(), settings.admin_listen, "admin (/metrics, /v1/runtime)"),
    ):
        host, _, port = address.rpartition(":")
        runner, bound = await serve_app(served, host or "0.0.0.0", int(port))
        runners.append(runner)
        log.info("%s listening on %s", what, bound)
    log.info("calibrating")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runtime.calibrate()
        log.info("calibrated at %d tokens; serving", runtime.largest)
        await stop.wait()
    finally:
        source.cancel()
        flusher.cancel()
        await asyncio.gather(source, flusher, return_exceptions=True)
        for runner in runners:
            await runner.cleanup()
        model.close()
        if door is not None and isinstance(door.review, TokenReviewer):
            await door.review.close()


async def _model(settings: LaneProcessSettings, state: LaneState) -> LaneModel:
    """The lane's model, on the device unless its lease is in host memory (or not placed)."""
    sha = settings.model_sha256
    if sha is None:
        from continuum_operator.gguf import file_sha256

        sha = await asyncio.to_thread(file_sha256, settings.model)
    gpu_layers = 0 if state.residence in (None, "host") else -1
    return LaneModel(
        settings.model, model_sha256=sha, n_gpu_layers=gpu_layers, n_threads=settings.threads
    )


def _door(settings: LaneProcessSettings, api: AsyncKubeApi | None = None) -> Door | None:
    """Token review, on unless the settings name no callers (`--unsafe-no-review`)."""
    if settings.callers is None:
        log.warning(
            "--unsafe-no-review: anyone who reaches this port is served embeddings, with no "
            "token; for a machine of one's own only"
        )
        return None
    audience, namespace = settings.callers.audience, settings.callers.namespace
    return Door(TokenReviewer(audience, api=api), audience, namespace)
