"""Settings of the operator's grants loop (`kube.grants.loop`) and leader election
(`kube.process.leader`): the `grants` and `leader` sections of
`kube.base.settings.OperatorSettings`.

In a module of their own, free of kopf and the Kubernetes client, so the `continuum` command's
parser stays quick. Every field says its unit, default and why; `continuum operator` fills them
from its flags (`cli.operator_sections`; docs/operator.md, "Grants" and "Leader election").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GrantSettings", "LeaderSettings"]


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
