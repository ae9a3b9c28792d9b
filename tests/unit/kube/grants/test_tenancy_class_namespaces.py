"""A MindClass's `allowedNamespaces`, enforced by the operator at every grant decision
(docs/tenancy.md), whatever admission let through: a class made after the Minds that name it (a
squatted name), a default class made after the classless Minds it then applies to, and a class
narrowed under a granted mind. The allocator decides (`core.grants`, `ClassNotAllowed`); the
grants loop reads the class and says why in her status and her ledger entry."""

from __future__ import annotations

from pathlib import Path

from continuum_operator.checklog import check_file
from continuum_operator.core.grants import (
    Capacity,
    EnginePhase,
    GrantReason,
    MindDemand,
    allocate,
)
from continuum_operator.kube.ledger import routing
from continuum_operator.model.mind import GrantState
from tests.support.grants_world import World, engine, mind

G, Q, R, X = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING, GrantState.RELEASED
SERVING_ONE = Capacity(EnginePhase.SERVING, 1, 1000)


def demand(
    name: str, priority: int = 0, arrival: float = 0.0, allowed: frozenset[str] | None = None
) -> MindDemand:
    return MindDemand(name, priority, arrival, 500, 0.0, None, allowed)


# --- the allocator ----------------------------------------------------------------------------


def test_a_mind_her_class_does_not_allow_is_refused_and_preempts_nobody() -> None:
    first = allocate({}, [demand("dev/low")], SERVING_ONE, 0.0)
    squatter = demand("dev/pager", priority=100, arrival=1.0, allowed=frozenset({"ops"}))
    later = allocate(first.grants, [demand("dev/low"), squatter], SERVING_ONE, 10.0)
    assert (later.grants["dev/pager"].state, later.grants["dev/pager"].reason) == (
        X,
        GrantReason.CLASS_NOT_ALLOWED,
    )
    assert later.grants["dev/low"].state is G  # not preempted
    assert [t.mind for t in later.transitions] == ["dev/pager"]


def test_a_mind_of_an_allowed_namespace_is_granted_and_an_empty_list_allows_none() -> None:
    ops = allocate({}, [demand("ops/a", allowed=frozenset({"ops"}))], SERVING_ONE, 0.0)
    assert ops.grants["ops/a"].state is G
    none = allocate({}, [demand("ops/a", allowed=frozenset())], SERVING_ONE, 0.0)
    assert none.grants["ops/a"].reason is GrantReason.CLASS_NOT_ALLOWED


def test_a_granted_mind_whose_class_narrows_is_reclaimed_and_requeued_once_it_widens() -> None:
    first = allocate({}, [demand("dev/a", allowed=frozenset({"dev"}))], SERVING_ONE, 0.0)
    narrowed = allocate(first.grants, [demand("dev/a", allowed=frozenset())], SERVING_ONE, 1.0)
    assert (narrowed.grants["dev/a"].state, narrowed.grants["dev/a"].reason) == (
        R,
        GrantReason.CLASS_NOT_ALLOWED,
    )
    released = allocate(
        narrowed.grants,
        [demand("dev/a", allowed=frozenset())],
        SERVING_ONE,
        2.0,
        released={"dev/a"},
    )
    assert (released.grants["dev/a"].state, released.grants["dev/a"].reason) == (
        X,
        GrantReason.CLASS_NOT_ALLOWED,
    )
    widened = allocate(released.grants, [demand("dev/a")], SERVING_ONE, 3.0)
    assert widened.grants["dev/a"].state is G


def test_the_refusals_are_moves_the_log_checker_allows(tmp_path: Path) -> None:
    # The transition log's reader (`continuum check-log`) knows the new reason.
    w = World(tmp_path)
    w.cls("urgent", priority=100, allowedNamespaces=["team-ops"])
    w.engine(engine("team-dev", "coder", slots=1))
    w.mind(mind("team-dev", "pager", "coder", className="urgent"))
    w.loop.pass_once()
    w.cache.observe_class(
        {"metadata": {"name": "urgent"}, "spec": {"priority": 100}}, deleted=False
    )
    w.loop.pass_once()
    w.cache.observe_class(
        {"metadata": {"name": "urgent"}, "spec": {"priority": 100, "allowedNamespaces": []}},
        deleted=False,
    )
    w.loop.pass_once()
    log = (tmp_path / "log.jsonl").read_text()
    assert "ClassNotAllowed" in log
    assert check_file(tmp_path / "log.jsonl") == []


# --- the grants loop: the class is read at every pass -----------------------------------------


def squat_world(tmp_path: Path) -> World:
    """team-dev: an engine of one slot, granted to `low` (class `std`, priority 0); `pager`
    arrives naming `urgent`, which does not exist yet."""
    w = World(tmp_path)
    w.cls("std", priority=0, protectionWindowSeconds=0)  # nothing protects her from preemption
    w.engine(engine("team-dev", "coder", slots=1))
    w.mind(mind("team-dev", "low", "coder", second=1, className="std"))
    w.loop.pass_once()
    return w


def test_a_class_squatted_before_it_exists_is_refused_once_it_does(tmp_path: Path) -> None:
    w = squat_world(tmp_path)
    w.mind(mind("team-dev", "pager", "coder", second=2, className="urgent"))
    w.loop.pass_once()
    assert w.granted("team-dev", "pager")["reason"] == "ClassNotFound"
    # The admin creates `urgent` for team-ops only: the Mind admission let in is refused now.
    urgent = {"priority": 100, "allowedNamespaces": ["team-ops"]}
    w.cache.observe_class({"metadata": {"name": "urgent"}, "spec": urgent}, deleted=False)
    w.loop.pass_once()
    assert w.ledger("team-dev", "coder") == {
        "team-dev/low": ("Granted", "SlotFree"),
        "team-dev/pager": ("Released", "ClassNotAllowed"),
    }
    status = w.status("minds", "team-dev", "pager")
    assert (status["grant"]["state"], status["grant"]["reason"]) == ("Refused", "ClassNotAllowed")
    message = status["grant"]["message"]
    assert "MindClass urgent may not be used by Minds of namespace team-dev" in message
    assert "it allows namespaces: team-ops" in message
    assert "spec.className" in message and "spec.allowedNamespaces" in message
    cond = w.granted("team-dev", "pager")
    assert (cond["status"], cond["reason"]) == ("False", "ClassNotAllowed")
    too_large = next(c for c in status["conditions"] if c["type"] == "ContextTooLarge")
    assert too_large["status"] == "False"  # she asks nothing too large: her namespace is refused


def test_a_default_class_made_later_for_another_namespace_gives_no_priority(
    tmp_path: Path,
) -> None:
    w = squat_world(tmp_path)
    w.mind(mind("team-dev", "classless", "coder", second=2))  # no class, none default yet
    w.loop.pass_once()
    assert w.ledger("team-dev", "coder")["team-dev/classless"] == ("Queued", "PoolFull")
    w.cache.observe_class(
        {"metadata": {"name": "ops-default"},
         "spec": {"priority": 100, "default": True, "allowedNamespaces": ["team-ops"],
                  "protectionWindowSeconds": 0}},
        deleted=False,
    )  # fmt: skip
    w.loop.pass_once()
    # She would preempt `low` at priority 100; the default class does not allow her namespace.
    assert w.ledger("team-dev", "coder") == {
        "team-dev/low": ("Granted", "SlotFree"),
        "team-dev/classless": ("Released", "ClassNotAllowed"),
    }
    message = w.status("minds", "team-dev", "classless")["grant"]["message"]
    assert "MindClass ops-default may not be used by Minds of namespace team-dev" in message


def test_class_facts_read_allowed_namespaces_absent_as_every_namespace() -> None:
    classes, _ = routing.classes_of(
        [
            {"metadata": {"name": "a"}, "spec": {"priority": 1}},
            {"metadata": {"name": "b"}, "spec": {"priority": 1, "allowedNamespaces": ["x"]}},
            {"metadata": {"name": "c"}, "spec": {"priority": 1, "allowedNamespaces": []}},
        ]
    )
    assert classes["a"].allowed_namespaces is None
    assert classes["b"].allowed_namespaces == frozenset({"x"})
    assert classes["c"].allowed_namespaces == frozenset()
