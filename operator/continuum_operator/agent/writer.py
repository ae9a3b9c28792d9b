"""The agent's only link to the API server: its NodeBoard's status and its node's Lease.

docs/design.md, "One writer per status field": the agent owns NodeBoard `status` (mode, pools,
measured usage) and writes it whole, as one JSON patch that replaces `/status`, only when
core/board_change.py says it changed. The board's freshness is a coordination.k8s.io Lease
(core/heartbeat.py names it), renewed every cycle with one merge patch. Both objects are owned by
the Node, so they go when the node goes. It also reads the pods the operator placed on this
node (for usage attribution) from the board's spec, where the operator writes them, and the
Node's annotations (HAMi registers there).

Errors: `AgentApiError` names the call that failed and the server's answer; the run loop logs it
and tries again next cycle (a board not written now is written at the next change check, since
the last *written* board is what changes are measured against).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes import client, config

from continuum_operator.core import rfc3339
from continuum_operator.core.heartbeat import (
    AGENT_LEASE_LABELS,
    LEASE_NAMESPACE,
    NODE_ANNOTATION,
    agent_lease_metadata,
    lease_name,
)
from continuum_operator.model.base import API_VERSION, GROUP, VERSION
from continuum_operator.model.board import NodeBoard, NodeBoardSpec, NodeBoardStatus

__all__ = ["AgentApi", "AgentApiError", "NodeFacts", "connect"]

FIELD_MANAGER = "continuum-agent"
_TIMEOUT = 15

log = logging.getLogger(__name__)


class AgentApiError(Exception):
    """A call to the API server failed: which call, on what, and the server's answer."""


@dataclass(frozen=True, slots=True)
class NodeFacts:
    uid: str
    annotations: Mapping[str, str]


def connect(kubeconfig: str | None, *, in_cluster: bool) -> client.ApiClient:
    configuration = client.Configuration()
    if in_cluster:
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


def _fail(what: str, err: client.ApiException) -> AgentApiError:
    body = (err.body or "").strip() if isinstance(err.body, str) else err.body
    return AgentApiError(f"{what}: {err.status} {err.reason}: {body}")


def _create(what: str, if_missing: str, create: Callable[[], object]) -> None:
    """Create `what`; one created meanwhile is fine (409). A 404 says that where it would be
    made is missing (a CRD, a namespace): `if_missing` says what to check."""
    try:
        create()
    except client.ApiException as err:
        if err.status == 404:
            raise _fail(f"creating {what} ({if_missing})", err) from err
        if err.status != 409:
            raise _fail(f"creating {what}", err) from err


class AgentApi:
    def __init__(
        self,
        api_client: client.ApiClient,
        node: str,
        *,
        identity: str,
        lease_namespace: str = LEASE_NAMESPACE,
        lease_seconds: int = 40,
    ) -> None:
        self.node = node
        self.identity = identity
        self.lease_namespace = lease_namespace
        self.lease_seconds = lease_seconds
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._coordination = client.CoordinationV1Api(api_client)

    # --- the Node --------------------------------------------------------------------------

    def node_facts(self) -> NodeFacts | None:
        """The Node's UID and annotations; None when no Node has this name (a bare machine)."""
        try:
            node = self._core.read_node(self.node, _request_timeout=_TIMEOUT)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise _fail(f"reading Node {self.node}", err) from err
        meta = node.metadata
        if meta is None or not meta.uid:
            raise AgentApiError(f"reading Node {self.node}: the server returned no metadata")
        return NodeFacts(uid=meta.uid, annotations=dict(meta.annotations or {}))

    def _owner(self, facts: NodeFacts | None) -> list[dict[str, Any]]:
        if facts is None:
            return []
        return [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": facts.uid}]

    def placed_pods(self) -> list[dict[str, str]] | None:
        """Pods on this node that the operator placed: `{"uid", "kind", "namespace", "name"}`,
        as the operator wrote them into the board's spec (the agent lists no pods: RBAC cannot
        bound a list to one node, docs/security.md). None while the board does not exist."""
        obj = self._board_object()
        if obj is None:
            return None
        spec = obj.get("spec")
        try:
            placed = NodeBoardSpec.model_validate(spec or {}).placed
        except ValueError as err:
            log.warning("NodeBoard %s: spec.placed unreadable, no pod attributed: %s", self.node,
                        err)  # fmt: skip
            return []
        return [p.model_dump(mode="json") for p in placed]

    # --- the NodeBoard ---------------------------------------------------------------------

    def _board_object(self) -> dict[str, Any] | None:
        """This node's NodeBoard as the API has it; None while there is none."""
        try:
            obj = self._custom.get_cluster_custom_object(
                GROUP, VERSION, NodeBoard.PLURAL, self.node, _request_timeout=_TIMEOUT
            )
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise _fail(f"reading NodeBoard {self.node}", err) from err
        return obj if isinstance(obj, dict) else {}

    def read_board(self) -> NodeBoardStatus | None:
        """The status last written (so a restarted agent does not rewrite an unchanged board)."""
        obj = self._board_object()
        status = obj.get("status") if obj is not None else None
        if not status:
            return None
        try:
            return NodeBoardStatus.model_validate(status)
        except ValueError:
            return None  # a board this agent cannot read is rewritten, not trusted

    def write_board(self, status: NodeBoardStatus, facts: NodeFacts | None) -> None:
        """Replace the board's whole status in one patch; create the board first if missing."""
        patch = [
            {
                "op": "add",  # `add` on an existing member replaces it
                "path": "/status",
                "value": status.model_dump(mode="json", by_alias=True, exclude_none=True),
            }
        ]
        for attempt in (1, 2):
            try:
                self._custom.patch_cluster_custom_object_status(
                    GROUP,
                    VERSION,
                    NodeBoard.PLURAL,
                    self.node,
                    patch,
                    field_manager=FIELD_MANAGER,
                    _content_type="application/json-patch+json",
                    _request_timeout=_TIMEOUT,
                )
                return
            except client.ApiException as err:
                if err.status != 404 or attempt == 2:
                    raise _fail(f"writing NodeBoard {self.node} status", err) from err
            self._create_board(facts)

    def _create_board(self, facts: NodeFacts | None) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": NodeBoard.KIND,
            "metadata": {"name": self.node, "ownerReferences": self._owner(facts)},
            "spec": {},
        }
        _create(
            f"NodeBoard {self.node}",
            "is the NodeBoard CRD installed? kubectl apply -f crds/",
            lambda: self._custom.create_cluster_custom_object(
                GROUP,
                VERSION,
                NodeBoard.PLURAL,
                body,
                field_manager=FIELD_MANAGER,
                _request_timeout=_TIMEOUT,
            ),
        )

    # --- the Lease -------------------------------------------------------------------------

    def renew_lease(self, now: datetime, facts: NodeFacts | None) -> None:
        """Renew the node's agent Lease (create it on the first beat)."""
        name = lease_name(self.node)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": rfc3339.format_micro(now),
        }
        try:
            self._coordination.patch_namespaced_lease(
                name,
                self.lease_namespace,
                # The labels too: a Lease made before they were set is selected from now on;
                # and the node it vouches for, so an annotation changed by another writer is
                # put back at the next beat (the operator reads the node from it).
                {
                    "metadata": {
                        "labels": AGENT_LEASE_LABELS,
                        "annotations": {NODE_ANNOTATION: self.node},
                    },
                    "spec": spec,
                },
                field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json",
                _request_timeout=_TIMEOUT,
            )
            return
        except client.ApiException as err:
            if err.status != 404:
                raise _fail(f"renewing Lease {self.lease_namespace}/{name}", err) from err
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                **agent_lease_metadata(self.node, self.lease_namespace),
                "ownerReferences": self._owner(facts),
            },
            "spec": {**spec, "acquireTime": rfc3339.format_micro(now)},
        }
        lease = client.V1Lease.from_dict(body)
        assert lease is not None
        _create(
            f"Lease {self.lease_namespace}/{name}",
            f"does namespace {self.lease_namespace} exist? see --lease-namespace",
            lambda: self._coordination.create_namespaced_lease(
                self.lease_namespace,
                lease,
                field_manager=FIELD_MANAGER,
                _request_timeout=_TIMEOUT,
            ),
        )
