"""The body of a Kubernetes Event (core/v1) the operator posts on an object it governs.

One builder for every Event: the loop's on Engines, the lanes' loop's on EmbedLanes, the
webhook's on pods admitted without it; `post` creates one for the two loops, whose failure to
post is only logged. `kubectl describe` and `kubectl get events` read the
`involvedObject`, `reason`, `message`, `type`, and the counts and timestamps of the old core/v1
fields; the `reporting*` fields are what events.k8s.io/v1 readers group by.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from continuum_operator.kube.client.async_api import AsyncKubeApi

__all__ = ["COMPONENT", "MESSAGE_LIMIT", "Event", "event", "post", "reference"]

#: The component the operator reports its Events as (`source.component`, `reportingComponent`).
COMPONENT = "continuum-operator"
#: The longest message the loops post (events.k8s.io/v1's limit on an Event's note, 1 kB).
MESSAGE_LIMIT = 1024


@dataclass(frozen=True, slots=True)
class Event:
    """What a loop has to say about an object it governs: the Event's type, reason, message."""

    type: str  # Normal | Warning
    reason: str
    message: str


class ObjectReference(TypedDict):
    """An Event's `involvedObject` as the operator writes it."""

    apiVersion: str
    kind: str
    name: str
    namespace: str
    uid: str | None


def reference(api_version: str, kind: str, meta: Mapping[str, object]) -> ObjectReference:
    """An Event's `involvedObject`: the object by kind, namespace, name and uid."""
    uid = meta.get("uid")
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": str(meta["name"]),
        "namespace": str(meta["namespace"]),
        "uid": str(uid) if uid is not None else None,
    }


def event(
    involved: Mapping[str, object],
    event_type: str,
    reason: str,
    message: str,
    *,
    component: str,
    instance: str,
    now: str,
    name: str | None = None,
    message_limit: int | None = MESSAGE_LIMIT,
) -> dict[str, object]:
    """An Event on `involved` (a `reference`), in its namespace, seen once at `now` (RFC 3339).

    Named `name` where one name per occurrence keeps a restarted operator from posting a twin
    (the API server refuses the second create); else the API server names it after the object.
    The message is cut at `message_limit` characters (None: posted whole).
    """
    meta: dict[str, object] = (
        {"name": name} if name is not None else {"generateName": f"{involved['name']}."}
    )
    meta["namespace"] = involved["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": meta,
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message if message_limit is None else message[:message_limit],
        "type": event_type,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


async def post(
    api: AsyncKubeApi,
    involved: Mapping[str, object],
    note: Event,
    *,
    instance: str,
    now: str,
    log: logging.Logger,
) -> None:
    """Create an `event` saying `note` on `involved` (a `reference`) as the operator's component.
    An Event is a note beside the work, never part of it: a refused create is a warning on
    `log`, not raised."""
    # kube.client.api imports the Kubernetes client: only once an Event is posted.
    from continuum_operator.kube.client.api import ApiError

    body = event(
        involved,
        note.type,
        note.reason,
        note.message,
        component=COMPONENT,
        instance=instance,
        now=now,
    )
    try:
        await api.create(body)
    except ApiError as err:
        log.warning("posting an event on %s %s failed: %s", involved["kind"], involved["name"], err)
