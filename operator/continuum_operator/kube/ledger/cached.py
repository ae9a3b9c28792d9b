"""An Engine's GrantLedger (`model.grant_ledger`) as the operator's decisions see it: inside the
cached Engine body.

The ledger lives in an object of its own, named as its Engine and owned by it, so a grant
does not rewrite the Engine (docs/grants.md, "Where the ledger lives"). The decisions were
written against the Engine's status and still read it there: the cache (`kube.state.cache`) merges
each GrantLedger's status into its Engine's cached body (`merged`), with the ledger's own
metadata beside it under `LEDGER_META`, so that a ledger write is conditioned on the version
of the ledger its step was decided from, never on a newer one seen meanwhile. Pure: no API
calls.

A GrantLedger left by an earlier Engine of the same name (deleted and made again before the
garbage collector removed its ledger) is owned by another uid: it is never merged (`owned_by`),
and the writer replaces it (`kube.grants.ledger_write`).
"""

from __future__ import annotations

from collections.abc import Mapping

from continuum_operator.kube.ledger.grant_ledger import LEDGER_FIELDS, read_entries
from continuum_operator.kube.ledger.routing import tokens_held
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.grant_ledger import GrantLedger, engine_owners
from continuum_operator.model.json_body import object_at
from continuum_operator.model.mind import HOLDING_STATES

__all__ = [
    "KIND",
    "LEDGER_META",
    "PLURAL",
    "HolderIndex",
    "engine_only",
    "held_tokens",
    "holders",
    "merged",
    "new_ledger",
    "others_entries",
    "owned_by",
    "uid_of",
    "version_of",
]

PLURAL = GrantLedger.PLURAL
KIND = GrantLedger.KIND
#: The key of a cached Engine body that holds its GrantLedger's metadata (absent: none yet).
LEDGER_META = "grantLedger"


def owned_by(ledger: Mapping[str, object], engine: Mapping[str, object]) -> bool:
    """Whether `ledger` is this Engine's: its owner is the Engine's uid (either side without a
    uid, as bodies built by hand in tests: yes)."""
    uid = object_at(engine, "metadata").get("uid")
    owners = engine_owners(ledger)
    return not uid or not owners or uid in owners


def merged(engine: Mapping[str, object], ledger: Mapping[str, object] | None) -> dict[str, object]:
    """The Engine body with `ledger`'s status as its ledger fields and its metadata under
    `LEDGER_META`; None or another Engine's ledger: an Engine with no ledger yet. Whatever
    ledger fields the Engine body carried (another one's merge) are replaced, not mixed."""
    status = {k: v for k, v in object_at(engine, "status").items() if k not in LEDGER_FIELDS}
    body = {k: v for k, v in engine.items() if k != LEDGER_META}
    if ledger is not None and owned_by(ledger, engine):
        status.update({k: v for k, v in object_at(ledger, "status").items() if k in LEDGER_FIELDS})
        body[LEDGER_META] = dict(object_at(ledger, "metadata"))
    body["status"] = status
    return body


def engine_only(body: Mapping[str, object]) -> dict[str, object]:
    """The Engine as the API server holds it, from a cached body (`model.engine.Engine`
    validates it: its status names no ledger field)."""
    return merged(body, None)


def uid_of(body: Mapping[str, object]) -> str | None:
    """The uid of the GrantLedger merged into this body (None: no ledger yet, or none given)."""
    uid = object_at(body, LEDGER_META).get("uid")
    return str(uid) if uid else None


def version_of(body: Mapping[str, object]) -> str | None:
    """The resourceVersion of the GrantLedger merged into this body (None: no ledger yet)."""
    version = object_at(body, LEDGER_META).get("resourceVersion")
    return str(version) if version else None


def new_ledger(engine: Mapping[str, object]) -> dict[str, object]:
    """The GrantLedger the writer creates for an Engine: its name and namespace, owned by it
    (the garbage collector deletes it with the Engine). No status: a create ignores it (the
    status subresource); the ledger is written next, conditioned on the new version."""
    meta = object_at(engine["metadata"])
    out: dict[str, object] = {"name": meta["name"], "namespace": meta["namespace"]}
    if meta.get("uid"):
        out["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": "Engine",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
            }
        ]
    return {"apiVersion": API_VERSION, "kind": GrantLedger.KIND, "metadata": out}


def _grants(ledger: Mapping[str, object] | None) -> list[GrantEntry]:
    """A GrantLedger object's entries (`status.grants`; none for no ledger), those read."""
    return read_entries(object_at(ledger, "status").get("grants"))


def _stored(ledger: Mapping[str, object]) -> object:
    """A GrantLedger's entries as stored (`status.grants`), unread."""
    return object_at(ledger, "status").get("grants")


def holders(ledger: Mapping[str, object] | None) -> frozenset[str]:
    """The Minds ("namespace/name") a GrantLedger holds a slot for (Granted or Reclaiming)."""
    return frozenset(e.mind for e in _grants(ledger) if e.state in HOLDING_STATES)


class HolderIndex:
    """Which GrantLedgers hold a slot for each Mind, kept as the ledgers change (`replace`):
    whether any ledger holds her is then one lookup, not a read of every ledger (a deleted
    Mind's finalizer asks it at each pass until it comes off)."""

    def __init__(self) -> None:
        self._by_mind: dict[str, set[tuple[str, str]]] = {}
        #: What each Engine's GrantLedger holds as indexed: the old ledger's holders are not
        #: read again at its next change (each read validates every entry).
        self._held: dict[tuple[str, str], frozenset[str]] = {}

    def replace(
        self,
        key: tuple[str, str],
        old: Mapping[str, object] | None,
        new: Mapping[str, object] | None,
    ) -> None:
        """The GrantLedger of Engine `key` went from `old` to `new` (None: none)."""
        before = self._held.pop(key, None)
        if before is None:
            before = holders(old)
        if new is None:
            after: frozenset[str] = frozenset()
        elif old is not None and _stored(old) == _stored(new):
            after = before  # the same entries (the echo of a write, a change elsewhere)
        else:
            after = holders(new)
        if new is not None:
            self._held[key] = after
        for mind in before - after:
            engines = self._by_mind.get(mind)
            if engines is not None:
                engines.discard(key)
                if not engines:
                    del self._by_mind[mind]
        for mind in after - before:
            self._by_mind.setdefault(mind, set()).add(key)

    def holds(self, mind: str) -> bool:
        """Whether any GrantLedger holds a slot for `mind` ("namespace/name")."""
        return mind in self._by_mind


def others_entries(
    ledgers: Mapping[tuple[str, str], Mapping[str, object]], mine: Mapping[tuple[str, str], object]
) -> dict[tuple[str, str], list[GrantEntry]]:
    """The entries of every GrantLedger whose Engine is not among `mine` (another operator's,
    or one this operator has just forgotten), by Engine: what they hold counts toward the
    namespaces' TokenQuotas all the same."""
    return {key: _grants(ledger) for key, ledger in ledgers.items() if key not in mine}


def held_tokens(ledger: Mapping[str, object] | None) -> dict[str, int]:
    """Tokens each namespace holds in a GrantLedger (what a TokenQuota counts)."""
    return tokens_held(_grants(ledger))
