"""Settings of the operator's grants loop (`kube.grants.loop`) and leader election
(`kube.process.leader`): the `grants` and `leader` sections of
`kube.base.settings.OperatorSettings`.

In a module of their own with their flags, free of kopf and the Kubernetes client, so the
`continuum` command's parser stays quick. Every field says its unit, default and why; `continuum
operator` fills them from flags (docs/operator.md, "Grants" and "Leader election").
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from continuum_operator.cli.args import SettingFlag, add_flags, settings_from_flags
from continuum_operator.model.base import label_selector

__all__ = ["GrantSettings", "LeaderSettings", "add_arguments", "grant_settings", "leader_settings"]


@dataclass(frozen=True, slots=True)
class GrantSettings:
    """How grants are made, reclaimed and recorded (docs/operator.md, "Grants")."""

    grace_seconds: float = 30.0
    """A reclaimed slot's grace: the gateway reports it released by then, or the release is
    forced (seconds). docs/design.md rule 7."""
    transition_log: Path | None = None
    """The JSON-lines transition log (docs/transition-log.md); None: not written."""
    engine_addresses: Mapping[str, str] = field(default_factory=dict)
    """`namespace/name` -> the URL minds reach that Engine's gateway at, where its Service
    cannot serve (an engine runtime run as a local process: the API server refuses loopback
    addresses in EndpointSlices). Others: `http://NAME.NAMESPACE.svc:PORT`."""
    write_workers: int = 32
    """Writes in flight at once: Engines' ledgers in a pass (the kernel's `writers`, one per
    Engine) and, apart, Minds' projections and finalizers (`kube.grants.write_queue`, one Mind's at
    a time). Each waits on the API server's answer, so the writes a second are at most this many
    over its answer time: at 8, 10,000 minds in bursts had both kinds of write near that ceiling
    (docs/performance.md)."""
    conflict_retries: int = 8
    """Re-reads of an Engine after a 409 before the step is left to the next pass."""


#: The flags that set GrantSettings, in the order `--help` shows them.
_GRANT_FLAGS = (
    SettingFlag(
        "--grace",
        "grace_seconds",
        "seconds a reclaimed slot has to be released before the release is forced",
        type=float,
    ),
    SettingFlag(
        "--transition-log",
        "transition_log",
        "append every ledger change to this JSON-lines file (docs/transition-log.md)",
        type=Path,
    ),
    SettingFlag(
        "--write-workers",
        None,  # grant_settings takes at least 1
        "writes in flight at once: Engines' ledgers (one engine each), Minds' projections",
        type=int,
        default=GrantSettings().write_workers,
    ),
    SettingFlag(
        "--engine-address",
        None,  # grant_settings checks each and makes the map
        "where minds reach an Engine's gateway instead of its Service (repeatable)",
        default=[],
        action="append",
        metavar="NS/NAME=URL",
    ),
)


def grant_settings(args: argparse.Namespace) -> GrantSettings:
    addresses: dict[str, str] = {}
    for item in args.engine_address:
        key, eq, url = str(item).partition("=")
        if not eq or "/" not in key or not url:
            raise SystemExit(f"error: --engine-address: {item!r} is not NAMESPACE/NAME=URL")
        addresses[key] = url.rstrip("/")
    return replace(
        settings_from_flags(GrantSettings(), _GRANT_FLAGS, args),
        engine_addresses=addresses,
        write_workers=max(1, args.write_workers),
    )


@dataclass(frozen=True, slots=True)
class LeaderSettings:
    enabled: bool = True
    """Elect a leader with a coordination.k8s.io Lease (off: this replica always leads; only
    for a single replica)."""
    namespace: str = "default"
    """Namespace of the Lease: the operator's own in a cluster ($POD_NAMESPACE)."""
    name: str = "continuum-operator"
    """The Lease's name. Operators serving different Engines (`--engine-selector`) are
    different groups: by default the selector's digest is appended."""
    duration_seconds: float = 15.0
    """A Lease not renewed this long may be taken by a standby (seconds; client-go's default).
    The leader stops writing a little before (`kube.process.leader`)."""
    renew_seconds: float = 2.0
    """How often the leader renews and a standby looks (seconds). Shorter than the duration
    less the margin, or the leader's own deadline passes between two renewals."""

    @property
    def margin_seconds(self) -> float:
        """How long before the Lease may be taken the leader stops writing: its clock and the
        standby's may drift, and its last renewal may have landed late (`kube.process.leader`)."""
        return min(2.0, self.duration_seconds / 5)


def _leader_flags() -> tuple[SettingFlag, ...]:
    """The flags that set LeaderSettings, in the order `--help` shows them (a function: the
    default of --leader-namespace is read from the environment when the parser is made)."""
    return (
        SettingFlag(
            "--leader-election",
            "enabled",
            "elect a leader with a coordination.k8s.io Lease (standby replicas wait)",
            action=argparse.BooleanOptionalAction,
        ),
        SettingFlag(
            "--leader-namespace",
            "namespace",
            "namespace of the leader Lease (default: $POD_NAMESPACE, else default)",
            default=os.environ.get("POD_NAMESPACE", LeaderSettings().namespace),
        ),
        SettingFlag(
            "--leader-lease",
            None,  # leader_settings names the Lease: the default, with the selector's digest
            "name of the leader Lease",
            default="",
        ),
        SettingFlag(
            "--leader-lease-duration",
            "duration_seconds",
            "seconds an unrenewed leader Lease keeps its holder",
            type=float,
        ),
        SettingFlag(
            "--leader-renew",
            "renew_seconds",
            "seconds between renewals (and a standby's looks)",
            type=float,
        ),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, _GRANT_FLAGS, GrantSettings())
    add_flags(p, _leader_flags(), LeaderSettings())


def leader_settings(args: argparse.Namespace, engine_labels: Mapping[str, str]) -> LeaderSettings:
    name = args.leader_lease or LeaderSettings().name
    if not args.leader_lease and engine_labels:
        text = label_selector(engine_labels)
        name = f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    settings = replace(settings_from_flags(LeaderSettings(), _leader_flags(), args), name=name)
    deadline = settings.duration_seconds - settings.margin_seconds
    if settings.enabled and settings.renew_seconds >= deadline:
        raise SystemExit(
            f"error: --leader-renew {settings.renew_seconds:g} must be shorter than "
            f"--leader-lease-duration {settings.duration_seconds:g} less the leader's margin of "
            f"{settings.margin_seconds:g} s (under {deadline:g} s): the leader would stop leading "
            "between two of its own renewals and a standby could take the Lease; renew more "
            "often or lengthen the Lease (the defaults: 2 and 15)"
        )
    return settings
