"""JSON merge patches (RFC 7386) as the API server applies them, and the patch one status
writer sends: the plan loop's and the lanes' status writes, and the cache's assumed bodies
(`kube.state.cache`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import overload

__all__ = ["merge_diff", "merge_patch", "status_patch"]


@overload
def merge_patch(target: object, patch: Mapping[str, object]) -> dict[str, object]: ...
@overload
def merge_patch(target: object, patch: object) -> object: ...
def merge_patch(target: object, patch: object) -> object:
    """A JSON merge patch (RFC 7386) applied as the API server applies it; `target` is not
    changed (bodies in the cache are replaced, never changed in place)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def merge_diff(old: object, new: object) -> object:
    """The JSON merge patch that turns `old` into `new` (`merge_patch(old, merge_diff(old,
    new)) == new`): a key `old` has and `new` has not is sent as null. Without it a status
    field written as a whole object would keep the keys a later decision dropped (an
    `enforcement` cap that no longer applies), since a merge patch only adds and replaces."""
    if not isinstance(new, Mapping) or not isinstance(old, Mapping):
        return copy.deepcopy(new)
    out: dict[str, object] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            out[k] = merge_diff(old.get(k), v)
    return out


def status_patch(status: Mapping[str, object], new: Mapping[str, object]) -> dict[str, object]:
    """The merge patch of the status fields one writer decided (`new`), from what `status`
    holds to `new`; the fields `new` does not name are other writers' and left as they are."""
    return {k: merge_diff(status.get(k), v) for k, v in new.items() if status.get(k) != v}
