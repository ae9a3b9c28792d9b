"""Tenancy on the real control plane (docs/tenancy.md): the chart's ValidatingAdmissionPolicies,
rendered by `helm template` and judged by kube-apiserver itself, and `continuum operator` as a
subprocess keeping a Mind of another namespace off an Engine that does not serve hers and a
namespace's minds within its TokenQuota.

The policies are cluster-wide objects in a cluster other tests share: each test scopes its
binding to namespaces carrying its own label, and deletes policy and binding when it ends."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.admission_policies import (
    SCOPE,
    install_checked,
    installed,
    scoped_namespace,
    tag,
)
from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.grant_ledger import grant_of, ledger, serving, states
from tests.support.grants_operator import operator
from tests.support.helm import by_kind, documents, find_helm, template
from tests.support.kwok_nodes import fresh_gpu_node
from tests.support.mind_specs import SLOT_TOKENS, engine, mind, mind_class
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds", "installed", "tag"]  # fixtures, used by name


def policies(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's MindClass policy and binding as `helm template` renders them (the chart's
    other policies, on engine sources, engine status and agent Leases, are test_boundaries';
    the engines' class guard, test_engine_class's)."""
    docs = documents(template(find_helm(), values, release="e2e").stdout)
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    tenancy = ("-mindclass-namespaces",)
    return [
        d for k in kinds for d in by_kind(docs, k)
        if any(part in d["metadata"]["name"] for part in tenancy)
    ]  # fmt: skip


def create(
    cluster: Cluster, body: dict[str, Any], ns: str, dry_run: bool = False
) -> subprocess.CompletedProcess[str]:
    args = ["create", "-f", "-", "-n", ns, *(["--dry-run=server"] if dry_run else [])]
    return cluster.kubectl(*args, input=json.dumps(body), check=False)


def refused_once_active(
    cluster: Cluster, body: dict[str, Any], ns: str
) -> subprocess.CompletedProcess[str]:
    """A server-side dry run of `body` in `ns`, repeated until a policy refuses it (a new
    policy takes a moment to reach the API server's admission chain)."""
    refused: subprocess.CompletedProcess[str] = wait_for(
        f"a policy refusing {body['kind']} {body['metadata']['name']} in {ns}",
        lambda: (p := create(cluster, body, ns, dry_run=True)).returncode != 0 and p,
        timeout=60,
    )
    return refused


# --------------------------------------------------------------------------------------------


def test_a_mind_of_a_namespace_her_class_does_not_allow_is_refused_by_the_api_server(
    cluster: Cluster,
    crds: None,
    tag: str,
    installed: Callable[[list[dict[str, Any]]], None],
) -> None:
    allowed = scoped_namespace(cluster, tag)
    other = scoped_namespace(cluster, tag)
    docs = policies(
        {"tenancy": {"mindClassPolicy": {"namespaceSelector": {"matchLabels": {SCOPE: tag}}}}}
    )
    # The API server type-checks the CEL against the MindClass and Mind schemas: no warnings.
    install_checked(cluster, installed, docs)

    gold, open_cls = f"gold-{tag}", f"open-{tag}"
    restricted = {**mind_class(gold, 5), "spec": {"priority": 5, "allowedNamespaces": [allowed]}}
    cluster.apply([restricted, mind_class(open_cls, 0)])
    try:
        refused = refused_once_active(cluster, mind("ann", gold), other)
        assert "denied request" in refused.stderr, refused.stderr
        for words in (
            f"MindClass {gold} may not be used by Minds of namespace {other}",
            f"it allows namespaces: {allowed}",
            "Name a class your namespace may use in spec.className",
            f"add {other} to the MindClass spec.allowedNamespaces",
        ):
            assert words in refused.stderr, refused.stderr
        # Every class is a parameter: the open class, and the restricted one elsewhere, pass.
        made = create(cluster, mind("bob", open_cls), other)
        assert made.returncode == 0, made.stderr
        made = create(cluster, mind("cid", gold), allowed)
        assert made.returncode == 0, made.stderr
        # Updates that keep the class pass (the operator's finalizer patches); a change of class
        # to one the namespace may not use is refused.
        cluster.kubectl("label", "mind", "bob", "-n", other, "e2e=touched")
        moved = cluster.kubectl(
            "patch", "mind", "bob", "-n", other, "--type=merge",
            "-p", json.dumps({"spec": {"className": gold}}), check=False,
        )  # fmt: skip
        assert moved.returncode != 0 and f"MindClass {gold}" in moved.stderr, moved.stderr

        # A Mind naming no class is checked against the default class.
        cluster.kubectl(
            "patch", "mindclass", gold, "--type=merge", "-p", '{"spec": {"default": true}}'
        )
        classless = mind("dee", gold)
        del classless["spec"]["className"]
        refused = wait_for(
            "the default class checked",
            lambda: (p := create(cluster, classless, other, dry_run=True)).returncode != 0 and p,
        )
        assert f"MindClass {gold} (the default class) may not be used" in refused.stderr
    finally:
        cluster.kubectl("delete", "mindclass", gold, open_cls, "--wait=false", check=False)


def ready(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    body = cluster.get_json("mind", name, "-n", ns)
    conds = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Granted"), {})


def test_a_mind_naming_an_engine_that_does_not_serve_her_namespace_gets_a_condition_not_a_grant(
    cluster: Cluster, crds: None, tag: str, tmp_path: Path
) -> None:
    home = scoped_namespace(cluster, tag)
    guest = scoped_namespace(cluster, tag)
    label = ("continuum.dev/e2e-grants", f"t{tag}")
    fresh_gpu_node(cluster, f"t{tag}")
    cls = mind_class(f"std-{tag}", 0)
    cluster.apply(cls)
    try:
        cluster.apply(engine("coder", f"t{tag}", label, minds=2), "-n", home)
        outsider = {**mind("ann", cls["metadata"]["name"])}
        outsider["spec"] = {**outsider["spec"], "engineNamespace": home}
        with operator(cluster, tmp_path, label):
            log = tmp_path / "operator.log"
            wait_for("the engine serving", serving(cluster, home, 2), log=log)
            cluster.apply(outsider, "-n", guest)
            cond = wait_for(
                "ann told why", lambda: ready(cluster, guest, "ann").get("reason"), log=log
            )
            assert cond == "EngineNotAllowed"
            message = ready(cluster, guest, "ann")["message"]
            assert f"Engine {home}/coder does not serve namespace {guest}" in message
            assert "spec.allowedNamespaces" in message
            assert states(cluster, home) == {}
            refused = grant_of(cluster, guest, "ann")  # `kubectl get minds` says it too
            assert (refused["state"], refused["reason"], refused["tokens"]) == (
                "Refused", "EngineNotAllowed", 0
            )  # fmt: skip

            # The Engine's owner lets the namespace in: she is granted, on the Engine's gateway.
            cluster.kubectl(
                "patch", "engine", "coder", "-n", home, "--type=merge",
                "-p", json.dumps({"spec": {"allowedNamespaces": [guest]}}),
            )  # fmt: skip
            wait_for(
                "ann granted",
                lambda: grant_of(cluster, guest, "ann").get("state") == "Granted",
                log=log,
            )
            ledger = cluster.ledger_status(home, "coder")["grants"]
            assert [e["mind"] for e in ledger] == [f"{guest}/ann"]
            endpoint = cluster.get_json("mind", "ann", "-n", guest)["status"]["endpoint"]
            assert endpoint == f"http://coder.{home}.svc:8080"
    finally:
        cluster.kubectl("delete", "mindclass", cls["metadata"]["name"], "--wait=false", check=False)


def test_a_namespace_over_its_token_quota_queues_its_minds_with_the_reason(
    cluster: Cluster, crds: None, tag: str, tmp_path: Path
) -> None:
    ns = scoped_namespace(cluster, tag)
    label = ("continuum.dev/e2e-grants", f"q{tag}")
    fresh_gpu_node(cluster, f"q{tag}")
    cls = mind_class(f"std-{tag}", 0)
    cluster.apply(cls)
    quota = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "TokenQuota",
        "metadata": {"name": "tokens"},
        "spec": {"maxTokens": SLOT_TOKENS},
    }
    try:
        cluster.apply([engine("coder", f"q{tag}", label, minds=2), quota], "-n", ns)
        with operator(cluster, tmp_path, label):
            log = tmp_path / "operator.log"
            wait_for("the engine serving", serving(cluster, ns, 2), log=log)
            name = cls["metadata"]["name"]
            cluster.apply(mind("first", name), "-n", ns)
            wait_for("first granted", lambda: states(cluster, ns) == {"first": "Granted"}, log=log)
            cluster.apply(mind("second", name), "-n", ns)

            def held_back() -> bool:
                entry = cluster.ledger_status(ns, "coder").get("grants") or []
                reasons = {e["mind"].split("/")[1]: (e["state"], e["reason"]) for e in entry}
                return reasons.get("second") == ("Queued", "QuotaExceeded")

            wait_for("second held back by the quota", held_back, log=log)
            # A slot stays free: the quota, not the pool, holds her.
            assert states(cluster, ns) == {"first": "Granted", "second": "Queued"}
            wait_for(
                "her projection",
                lambda: grant_of(cluster, ns, "second").get("reason") == "QuotaExceeded",
                log=log,
            )
            message = grant_of(cluster, ns, "second")["message"]
            assert f"TokenQuota {ns}/tokens allows namespace {ns} {SLOT_TOKENS} tokens" in message
            assert f"its minds hold {SLOT_TOKENS}" in message

            def quota_status() -> dict[str, Any] | None:
                status = cluster.get_json("tokenquota", "tokens", "-n", ns).get("status") or {}
                return status if status.get("mindsQueued") == 1 else None

            status = wait_for("the quota's status", quota_status, log=log)
            assert (status["usedTokens"], status["mindsHeld"], status["queued"]) == (
                SLOT_TOKENS, 1, ["second"]
            )  # fmt: skip
            assert status["conditions"][0]["reason"] == "MindsQueued"

            # The quota raised: she is granted the free slot.
            cluster.kubectl(
                "patch", "tokenquota", "tokens", "-n", ns, "--type=merge",
                "-p", json.dumps({"spec": {"maxTokens": 2 * SLOT_TOKENS}}),
            )  # fmt: skip
            wait_for(
                "second granted",
                lambda: states(cluster, ns) == {"first": "Granted", "second": "Granted"},
                log=log,
            )
    finally:
        cluster.kubectl("delete", "mindclass", cls["metadata"]["name"], "--wait=false", check=False)


def test_a_class_squatted_before_it_exists_and_a_default_made_later_give_no_priority(
    cluster: Cluster, crds: None, tag: str, tmp_path: Path
) -> None:
    # Admission checks a Mind's class at create or a class change, and lets a class that does
    # not exist through (parameterNotFoundAction: Allow); the operator checks at every grant.
    dev = scoped_namespace(cluster, tag)
    ops = scoped_namespace(cluster, tag)
    label = ("continuum.dev/e2e-grants", f"s{tag}")
    fresh_gpu_node(cluster, f"s{tag}")
    std = {**mind_class(f"std-{tag}", 0)}
    urgent = {**mind_class(f"urgent-{tag}", 100)}
    urgent["spec"] = {**urgent["spec"], "allowedNamespaces": [ops]}
    default = {**mind_class(f"default-{tag}", 100)}
    default["spec"] = {**default["spec"], "allowedNamespaces": [ops], "default": True}
    cluster.apply(std)
    try:
        cluster.apply(engine("coder", f"s{tag}", label, minds=1), "-n", dev)
        with operator(cluster, tmp_path, label):
            log = tmp_path / "operator.log"
            wait_for("the engine serving", serving(cluster, dev, 1), log=log)
            cluster.apply(mind("low", std["metadata"]["name"]), "-n", dev)
            wait_for("low granted", lambda: states(cluster, dev) == {"low": "Granted"}, log=log)
            cluster.apply(mind("pager", urgent["metadata"]["name"]), "-n", dev)
            classless = mind("quiet", std["metadata"]["name"])
            del classless["spec"]["className"]
            cluster.apply(classless, "-n", dev)
            wait_for(
                "pager told her class does not exist",
                lambda: ready(cluster, dev, "pager").get("reason") == "ClassNotFound",
                log=log,
            )
            wait_for("quiet queued", lambda: states(cluster, dev).get("quiet") == "Queued")

            # The admin makes both classes for ops only: neither mind of dev gets priority 100.
            cluster.apply([urgent, default])

            def refused() -> dict[str, Any] | None:
                entries = ledger(cluster, dev)
                got = {m: (e["state"], e["reason"]) for m, e in entries.items()}
                want = ("Released", "ClassNotAllowed")
                return got if got.get("pager") == want and got.get("quiet") == want else None

            got = wait_for("pager and quiet refused in the ledger", refused, log=log)
            assert got["low"] == ("Granted", "SlotFree")  # not preempted
            for name, cls in (("pager", urgent), ("quiet", default)):

                def projected(n: str = name) -> dict[str, Any] | None:
                    g = grant_of(cluster, dev, n)
                    return g if g.get("state") == "Refused" else None

                grant = wait_for(f"{name}'s status", projected, log=log)
                assert grant["reason"] == "ClassNotAllowed"
                assert (
                    f"MindClass {cls['metadata']['name']} may not be used by Minds of namespace "
                    f"{dev}; it allows namespaces: {ops}"
                ) in grant["message"]
                assert ready(cluster, dev, name)["reason"] == "ClassNotAllowed"
            assert states(cluster, dev)["low"] == "Granted"
    finally:
        names = [c["metadata"]["name"] for c in (std, urgent, default)]
        cluster.kubectl("delete", "mindclass", *names, "--wait=false", check=False)


def test_a_resource_quota_caps_a_namespaces_count_of_minds_and_engines(
    cluster: Cluster, crds: None, tag: str
) -> None:
    """What a namespace's objects cost the operator is bounded by their count (docs/tenancy.md):
    a plain ResourceQuota's object counts, `count/minds.continuum.dev`, enforced by the API
    server on custom resources."""
    ns = scoped_namespace(cluster, tag)
    limits = {"count/minds.continuum.dev": "2", "count/engines.continuum.dev": "1"}
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "objects", "namespace": ns},
        "spec": {"hard": limits},
    }

    def counted() -> bool:
        """The quota admits nothing it has not counted. The controller counts a custom
        resource once its discovery (every 30 s) has seen the CRD; a quota made before that is
        counted at its full resync (5 min): made again until it is counted at once."""
        status = cluster.get_json("resourcequota", "objects", "-n", ns).get("status") or {}
        if set(status.get("used") or {}) == set(limits):
            return True
        cluster.kubectl("delete", "resourcequota", "objects", "-n", ns)
        cluster.apply(quota)
        time.sleep(5)
        return False

    cluster.apply(quota)
    wait_for("the quota counted", counted, timeout=120)
    for name in ("a", "b"):
        made = create(cluster, mind(name, "standard"), ns)
        assert made.returncode == 0, made.stderr
    third = create(cluster, mind("c", "standard"), ns)
    assert third.returncode != 0, third.stdout
    assert "exceeded quota: objects" in third.stderr, third.stderr
    assert "limited: count/minds.continuum.dev=2" in third.stderr, third.stderr
    first = create(cluster, engine("coder", tag, ("e2e", tag)), ns)
    assert first.returncode == 0, first.stderr
    second = create(cluster, engine("other", tag, ("e2e", tag)), ns)
    assert "limited: count/engines.continuum.dev=1" in second.stderr, second.stderr
