"""The operator's cache keeps the newest of what it saw, whichever way it arrived."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.kube.client.merge_patch import merge_diff, merge_patch
from continuum_operator.kube.state.cache import Cache


def deployment(rv: int, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "minds", "name": "e", "resourceVersion": str(rv),
                     "generation": 1},
        "spec": {"template": {"metadata": {"annotations": {}}}},
        "status": {"observedGeneration": 1, "readyReplicas": ready, "updatedReplicas": 1,
                   "replicas": 1},
    }  # fmt: skip


def test_the_answer_of_an_apply_does_not_undo_a_newer_watch_event() -> None:
    cache = Cache()
    cache.observe_deployment(deployment(rv=12, ready=1), deleted=False)  # the watch: pod ready
    cache.observe_deployment(deployment(rv=10, ready=0), deleted=False, nudge=False)  # our write
    assert cache.deployments[("minds", "e")].ready_replicas == 1


def test_the_view_a_decision_reads_is_the_cache_as_a_snapshot_copies_it() -> None:
    # The plan loop decides from `view()` (no copy); the lanes' loop from `snapshot()`.
    cache = Cache()
    cache.observe_deployment(deployment(rv=10, ready=0), deleted=False)
    cache.observe_node({"metadata": {"name": "n1"}, "status": {}}, deleted=False)
    view, copied = cache.view(), cache.snapshot()
    assert view == copied and view.deployments[("minds", "e")].ready_replicas == 0
    cache.observe_deployment(deployment(rv=11, ready=1), deleted=False)
    assert cache.view().deployments[("minds", "e")].ready_replicas == 1  # as it is now
    assert copied.deployments[("minds", "e")].ready_replicas == 0  # a copy keeps its time


def test_a_newer_deployment_replaces_an_older_one() -> None:
    cache = Cache()
    cache.observe_deployment(deployment(rv=10, ready=0), deleted=False)
    cache.observe_deployment(deployment(rv=11, ready=1), deleted=False)
    assert cache.deployments[("minds", "e")].ready_replicas == 1
    cache.observe_deployment(deployment(rv=11, ready=1), deleted=True)
    assert ("minds", "e") not in cache.deployments


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abcd"), inner, max_size=4)
    ),
    max_leaves=12,
)
# What a status holds: no nulls (a merge patch cannot write one, it deletes).
_stored = st.recursive(
    st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abcd"), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(old=_json, new=_stored)
def test_the_merge_diff_turns_the_old_into_the_new(old: Any, new: Any) -> None:
    assert merge_patch(old, merge_diff(old, new)) == new
