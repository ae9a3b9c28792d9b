"""What the operator's caches keep of an object: all of it but what no decision reads.

Every object the API server sends carries `metadata.managedFields` (server-side apply's field
ownership: often larger than the spec), and one applied with `kubectl apply` a copy of the whole
applied manifest in the `kubectl.kubernetes.io/last-applied-configuration` annotation. Its
annotations are its writers' to fill, up to the API server's 256 KiB: 2,000 Minds of 240 KB
each were 480 MB a cache would hold for nothing. Decisions read one annotation of the objects
kept here (Minds, Engines, GrantLedgers, EmbedLanes, MindClasses, TokenQuotas): an Engine's
acceptance of a held plan. None is kept but those named in KEPT_ANNOTATIONS
(`bench/cache_memory.py` measures it). The rest is kept whole (spec, status, labels, the rest
of the metadata), so no field a decision reads can go missing by omission.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from continuum_operator.core.replan import ACCEPT_ANNOTATION
from continuum_operator.model.json_body import object_at

__all__ = ["KEPT_ANNOTATIONS", "LAST_APPLIED", "kept", "newer", "resource_version"]

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
KEPT_ANNOTATIONS: frozenset[str] = frozenset({ACCEPT_ANNOTATION})
"""The annotations of a cached object some decision reads: an Engine's acceptance of a held
plan (`core.replan`, read by `kube.engines.placed`). A decision that comes to read another names
it here; every other annotation is dropped from the caches."""


def kept(obj: Mapping[str, object]) -> dict[str, object]:
    """A deep copy of `obj` without its managed fields and annotations (but KEPT_ANNOTATIONS).

    The annotations are not copied before they are dropped: what the cache holds grows with
    the fields decisions read, not with what a writer put in its annotations."""
    body = {k: copy.deepcopy(v) for k, v in obj.items() if k != "metadata"}
    meta = obj.get("metadata")
    if isinstance(meta, Mapping):
        slim = {
            k: copy.deepcopy(v)
            for k, v in meta.items()
            if k not in ("managedFields", "annotations")
        }
        annotations = meta.get("annotations")
        if isinstance(annotations, Mapping):
            read = {k: str(v) for k, v in annotations.items() if k in KEPT_ANNOTATIONS}
            if read:
                slim["annotations"] = read
        body["metadata"] = slim
    return body


def resource_version(obj: Mapping[str, object]) -> int:
    """An object's resourceVersion as a number, to order what the caches keep (0: none)."""
    try:
        return int(str(object_at(obj, "metadata").get("resourceVersion") or 0))
    except ValueError:
        return 0


def newer(obj: Mapping[str, object], known: Mapping[str, object] | None) -> bool:
    """Whether a cache takes `obj` over the body it has of the name: a watch event older than
    the answer of the cache's own write (or than an event already seen) must not undo it. An
    equal version is taken (the same object, as answered and as watched)."""
    return known is None or resource_version(obj) >= resource_version(known)
