"""A mind's child pods run below the engine serving her (docs/design.md rule 8, docs/children.md).

A mutating admission webhook, served by kopf's admission support, gives every pod a mind spawns
(created by her service account, labelled `continuum.dev/mind: NAME`, or owned by a Mind) the
children's priority class, the
least CPU weight (a minimal CPU request and no CPU limit: they still use every idle core, and
yield to everything else under contention) and a mark for the runner inside the pod
(`continuum run`, `continuum_operator.procclass`): the annotation `continuum.dev/process-class`
and the variable `CONTINUUM_PROCESS_CLASS`, both `background`.

The pods her workloads make (a Deployment's, a Job's) are made by controllers, not by her: their
templates are mutated where she writes them (`kube.children.workloads`).

Its failure policy is Ignore: pod creation never blocks on the operator. So a child may arrive
unmutated (the operator down, slow or not yet started); a watch on children counts each one that
lacks the mark (a metric, and a Warning event on the pod), so none is silently missed.

What is decided here is pure and tested as such: `kube.children.membership.mutate` (a pod in, the
mutated pod and notes out), `webhook_configuration` (the MutatingWebhookConfiguration for a
client config) and `Unmarked` (which children lack the mark). `register` wires them into
kopf. Neighbours: `kube.children.membership` (what a child is), `kube.base.settings`
(`ChildrenSettings`, the class in `PodSettings`), `kube.workloads.priority_classes` (the class),
`kube.base.metrics`, `kube.process.run` (registers it), `cli.operator_sections` (`--webhook` and
the other flags that fill `ChildrenSettings`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from continuum_operator.core import rfc3339
from continuum_operator.kube.base import events
from continuum_operator.kube.base.readiness import MINDS_LISTED, WEBHOOK_SERVING, Readiness
from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children import workloads
from continuum_operator.kube.children.membership import (
    CLASS_ANNOTATION,
    MIND_LABEL,
    SERVICE_ACCOUNT_PREFIX,
    SYSTEM_ACCOUNTS,
    is_marked,
    mind_of,
    mutate,
)
from continuum_operator.kube.workloads.engine_objects import MANAGED_BY
from continuum_operator.kube.workloads.priority_classes import priority_classes
from continuum_operator.model.base import GROUP
from continuum_operator.model.json_body import object_at

if TYPE_CHECKING:  # imported when the operator starts: `continuum plan` loads neither
    import kopf

    from continuum_operator.kube.base.metrics import OperatorMetrics
    from continuum_operator.kube.client.async_api import AsyncKubeApi
    from continuum_operator.kube.state.mind_cache import MindCache

__all__ = [
    "HANDLER_ID",
    "Unmarked",
    "register",
    "webhook_configuration",
]

log = logging.getLogger("continuum.children")

HANDLER_ID = "mind-children"
"""kopf's id of the mutating handler: the last part of the webhook's URL path."""
UNMUTATED_REASON = "ChildNotMutated"
INSTALL_ATTEMPTS = 5


MATCH_CONDITION = (
    f"(has(object.metadata.labels) && '{MIND_LABEL}' in object.metadata.labels) || "
    "(has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
    f"r.kind == 'Mind' && r.apiVersion.startsWith('{GROUP}/'))) || "
    f"(request.userInfo.username.startsWith('{SERVICE_ACCOUNT_PREFIX}') && "
    f"!request.userInfo.username.startsWith('{SYSTEM_ACCOUNTS}'))"
)
"""Evaluated by the API server: a mind's labelled or owned children, and every pod a service
account outside kube-system creates itself (a mind's may be among them; the webhook asks its
Minds). Pods the controllers make (a Deployment's, a Job's) are created by kube-system's
accounts and are sent only when labelled: a mind's runtime labels their templates."""


def webhook_configuration(
    client_config: Mapping[str, object], children: ChildrenSettings
) -> dict[str, object]:
    """The MutatingWebhookConfiguration that sends a mind's new child pods to this operator,
    and the workloads a service account writes (`workloads.workloads_webhook`).

    `client_config` is what kopf's server yields (its URL and CA bundle); the handler's id is
    the URL's last part, as kopf routes it (kopf's server has no root path, so a Service
    reference's path is the id alone). With `children.service` the API server is sent to that
    Service (`clientConfig.service`), else to the URL. Kept when the operator stops: pods are
    then admitted unmutated (Ignore) and counted when it is back.
    """

    def client(handler_id: str) -> dict[str, object]:
        found: dict[str, object]
        if children.service is not None:
            namespace, name = children.service
            port = children.service_port if children.service_port is not None else children.port
            found = {
                "service": {
                    "namespace": namespace,
                    "name": name,
                    "port": port,
                    "path": f"/{handler_id}",
                }
            }
        else:
            found = {"url": f"{str(client_config['url']).rstrip('/')}/{handler_id}"}
        if client_config.get("caBundle"):
            found["caBundle"] = client_config["caBundle"]
        return found

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": children.webhook_name,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
        },
        "webhooks": [
            {
                "name": f"children.{GROUP}",
                "clientConfig": client(HANDLER_ID),
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                        "scope": "Namespaced",
                    }
                ],
                "matchConditions": [{"name": "a-minds-child", "expression": MATCH_CONDITION}],
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "timeoutSeconds": children.timeout_seconds,
                "admissionReviewVersions": ["v1"],
                "reinvocationPolicy": "IfNeeded",
                "matchPolicy": "Equivalent",
            },
            workloads.workloads_webhook(client(workloads.HANDLER_ID), children.timeout_seconds),
        ],
    }


@dataclass
class Unmarked:
    """Which living children of minds lack the webhook's mark (`observe` says when one is new)."""

    live: dict[str, tuple[str, str]] = field(default_factory=dict)
    """uid -> (namespace, name) of each unmarked child now present."""

    def observe(self, pod: Mapping[str, object], deleted: bool) -> bool:
        """Records one watch event; True the first time an unmarked child is seen."""
        meta = object_at(pod, "metadata")
        uid = str(meta.get("uid", ""))
        if deleted or mind_of(pod) is None or is_marked(pod):
            self.live.pop(uid, None)
            return False
        if uid in self.live:
            return False
        self.live[uid] = (str(meta.get("namespace")), str(meta.get("name")))
        return True

    def count(self, namespace: str) -> int:
        return sum(1 for ns, _ in self.live.values() if ns == namespace)


def unmutated_event(
    pod: Mapping[str, object], pods: PodSettings, instance: str, now: str
) -> dict[str, object]:
    """A Warning on the pod; its name is fixed per pod, so a restarted operator posts no twin."""
    meta = object_at(pod, "metadata")
    spec = object_at(pod, "spec")
    message = (
        f"Pod {meta['namespace']}/{meta['name']} of mind {mind_of(pod)} was admitted without "
        f"the children's webhook (no {CLASS_ANNOTATION} mark): it runs at priority "
        f"{spec.get('priority', 0)} ({spec.get('priorityClassName') or 'no class'}) instead of "
        f"{pods.children_priority_class}, with its own CPU weight, and can slow the engine. "
        "Is the operator running with --webhook, and its MutatingWebhookConfiguration reachable?"
    )
    # Posted whole (no cut at events.MESSAGE_LIMIT), as it always was.
    return events.event(
        events.reference("v1", "Pod", meta),
        "Warning",
        UNMUTATED_REASON,
        message,
        component=events.COMPONENT,
        instance=instance,
        now=now,
        name=f"{str(meta['name'])[:200]}.unmutated.{str(meta.get('uid', ''))[:8]}",
        message_limit=None,
    )


# --------------------------------------------------------------------------------------------
# TLS: kopf's self-signed certificate needs `certbuilder`; without it, openssl makes one.


def self_signed(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
    """A self-signed certificate (its own CA) for `hostnames`, and its key, in PEM."""
    import kopf

    try:
        return kopf.WebhookServer.build_certificate(hostnames, password)
    except ImportError:  # kopf's MissingDependencyError: no certbuilder
        pass
    sans: list[str] = []
    names = [h for h in hostnames if h]
    for name in dict.fromkeys(names):
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            sans.append(f"DNS:{name}")
        else:
            if not ip.is_unspecified:
                sans.append(f"IP:{ip}")
    common = next((n for n in names if not _is_ip(n)), names[0] if names else "localhost")
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365",
             "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={common}",
             "-addext", "subjectAltName=" + ",".join(sans or ["DNS:localhost"])],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        return cert.read_bytes(), key.read_bytes()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# kopf wiring


class _Installing:
    """kopf's webhook server, installing our configuration each time it (re)starts serving."""

    def __init__(
        self,
        server: kopf.WebhookServerProtocol,
        install: Callable[[Mapping[str, object]], Awaitable[None]],
        readiness: Readiness,
    ) -> None:
        self.server = server
        self.install = install
        self.readiness = readiness

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        # kopf's server yields once it listens: the replica is ready for the Service's reviews
        # once the API server has the configuration that sends them.
        async for client_config in self.server(fn):
            await self.install(client_config)
            self.readiness.done(WEBHOOK_SERVING)
            yield client_config


def _server(children: ChildrenSettings) -> kopf.WebhookServer:
    import kopf

    class Server(kopf.WebhookServer):
        build_certificate = staticmethod(self_signed)

    return Server(
        addr=children.listen,
        port=children.port,
        host=children.host,
        certfile=children.certfile,
        pkeyfile=children.keyfile,
        cafile=children.cafile,
    )


async def install_webhook(
    api: AsyncKubeApi,
    pods: PodSettings,
    children: ChildrenSettings,
    client_config: Mapping[str, object],
) -> None:
    """The children's priority class, then the MutatingWebhookConfiguration pointing at this
    operator (kopf's admission server calls it with its client config)."""
    from continuum_operator.kube.client.api import ApiError

    # A failure here stops the operator (kopf's admission task ends): retried a few times
    # first, so that one refused call to the API server does not.
    for attempt in range(INSTALL_ATTEMPTS):
        try:
            # The class first: a pod naming a class that does not exist is refused, so no
            # child is sent to the webhook before its class is there.
            for priority_class in priority_classes(pods):
                await api.apply(priority_class)
            await api.apply(webhook_configuration(client_config, children))
            break
        except (ApiError, OSError) as err:
            if attempt == INSTALL_ATTEMPTS - 1:
                raise
            log.warning("installing the children's webhook failed (%s); retrying", err)
            await asyncio.sleep(2.0 * (attempt + 1))
    log.info("MutatingWebhookConfiguration %s installed", children.webhook_name)


def register(
    registry: kopf.OperatorRegistry,
    api: AsyncKubeApi,
    pods: PodSettings,
    children: ChildrenSettings,
    metrics: OperatorMetrics,
    minds: MindCache,
    readiness: Readiness,
) -> None:
    """Adds the count of unmarked children and, with `children.webhook`, the webhook itself,
    which asks `minds` (the operator's Mind cache) whether a pod's creator is a Mind. The
    Minds are listed into it before the webhook serves (kopf starts its admission server
    after the startup handlers), and `readiness` waits for both."""
    import kopf

    from continuum_operator.kube.state.mind_cache import list_minds

    _register_count(registry, api, pods, metrics)
    if not children.webhook:
        return

    async def install(client_config: Mapping[str, object]) -> None:
        await install_webhook(api, pods, children, client_config)

    @kopf.on.startup(registry=registry, backoff=2.0)
    async def minds_listed(**_: object) -> None:
        await list_minds(api, minds)
        readiness.done(MINDS_LISTED)

    @kopf.on.startup(registry=registry)
    def admission(settings: kopf.OperatorSettings, **_: object) -> None:
        settings.admission.server = _Installing(_server(children), install, readiness)
        settings.admission.managed = None  # ours: matchConditions and a short timeout

    @kopf.on.mutate("", "v1", "pods", id=HANDLER_ID, operations=["CREATE"],
                    ignore_failures=True, registry=registry)  # fmt: skip
    def children_class(
        body: kopf.Body,
        patch: kopf.Patch,
        warnings: list[str],
        dryrun: bool,
        userinfo: kopf.UserInfo | None = None,
        **_: object,
    ) -> None:
        creator = workloads.creator_mind(userinfo, minds)
        mutation = mutate(dict(body), pods, children, creator)
        if mutation is None:
            return
        workloads.answer(patch, warnings, mutation)
        if not dryrun:
            metrics.record_child_mutated(
                str(object_at(mutation.pod, "metadata").get("namespace", ""))
            )

    # The pods her Deployments, Jobs... make: their templates, where she writes them.
    workloads.register(registry, pods, children, minds)


def _register_count(
    registry: kopf.OperatorRegistry, api: AsyncKubeApi, pods: PodSettings, metrics: OperatorMetrics
) -> None:
    """The count of children admitted unmutated (the webhook down or off): a metric and an
    Event on each."""
    import kopf

    from continuum_operator.kube.client.api import ApiError

    unmarked = Unmarked()
    instance = socket.gethostname()

    async def post(pod: Mapping[str, object]) -> None:
        now = rfc3339.format_seconds(time.time())
        try:
            await api.create(unmutated_event(pod, pods, instance, now))
        except ApiError as err:
            if err.status != 409:  # 409: posted already, by this operator before a restart
                log.warning("posting ChildNotMutated on %s failed: %s", pod.get("metadata"), err)

    @kopf.on.startup(registry=registry)
    def children_on_server(settings: kopf.OperatorSettings, **_: object) -> None:
        # Only the children reach the operator: a label selector the API server applies (a
        # label filter alone would have every pod of the cluster cross the wire to be dropped).
        settings.watching.label_selectors["v1", "pods"] = MIND_LABEL

    @kopf.on.event("", "v1", "pods", labels={MIND_LABEL: kopf.PRESENT}, registry=registry)
    async def child(event: kopf.RawEvent, **_: object) -> None:
        pod: Mapping[str, object] = dict(event["object"])
        deleted = event.get("type") == "DELETED"
        meta = object_at(pod, "metadata")
        ns = str(meta.get("namespace"))
        if unmarked.observe(pod, deleted):
            log.warning("child pod %s/%s of mind %s is unmutated", ns, meta["name"], mind_of(pod))
            metrics.record_child_unmutated(ns)
            await post(pod)
        metrics.set_children_unmutated(ns, unmarked.count(ns))
