"""What the operator's caches keep of an object: all of it but what no decision reads.

Every object the API server sends carries `metadata.managedFields` (server-side apply's field
ownership: often larger than the spec), and one applied with `kubectl apply` a copy of the whole
applied manifest in the `kubectl.kubernetes.io/last-applied-configuration` annotation. Nothing in
the operator reads either; with ten thousand Minds they are most of what a cache would hold
(`bench/cache_memory.py` measures both). The rest is kept whole, so no field a decision reads
can go missing by omission.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["LAST_APPLIED", "kept", "newer", "resource_version"]

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def kept(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `obj` without its managed fields and kubectl's last-applied copy."""
    body = {k: copy.deepcopy(v) for k, v in obj.items() if k != "metadata"}
    meta = obj.get("metadata")
    if isinstance(meta, Mapping):
        slim = {k: copy.deepcopy(v) for k, v in meta.items() if k != "managedFields"}
        annotations = slim.get("annotations")
        if isinstance(annotations, dict) and LAST_APPLIED in annotations:
            slim["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
        body["metadata"] = slim
    return body


def resource_version(obj: Mapping[str, Any]) -> int:
    """An object's resourceVersion as a number, to order what the caches keep (0: none)."""
    try:
        return int(obj["metadata"].get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0


def newer(obj: Mapping[str, Any], known: Mapping[str, Any] | None) -> bool:
    """Whether a cache takes `obj` over the body it has of the name: a watch event older than
    the answer of the cache's own write (or than an event already seen) must not undo it. An
    equal version is taken (the same object, as answered and as watched)."""
    return known is None or resource_version(obj) >= resource_version(known)
