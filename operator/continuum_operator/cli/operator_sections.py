"""`continuum operator`'s flags of three sections of `OperatorSettings`: the grants loop's
(`GrantSettings`), the leader election's (`LeaderSettings`) and the children's webhook's
(`ChildrenSettings`); `cli.operator` adds them after its own and reads them back here.

A flag whose value alone can be wrong is checked by its argparse `type` (exit 2, argparse's
message naming the flag and what to write); two flags that must agree are checked by `refusal`,
which `cmd_operator` asks before the operator starts (exit 2 too, `cli/errors.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from continuum_operator.cli.args import SettingFlag, add_flags, at_least_one, settings_from_flags
from continuum_operator.kube.base.grant_settings import GrantSettings, LeaderSettings
from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children.membership import DNS_LABEL
from continuum_operator.model.base import label_selector

__all__ = [
    "add_arguments",
    "children_settings",
    "grant_settings",
    "leader_settings",
    "refusal",
]


def _engine_address(text: str) -> tuple[str, str]:
    """`--engine-address`'s type: `NAMESPACE/NAME=URL` as (`namespace/name`, the URL)."""
    key, eq, url = text.partition("=")
    if not eq or "/" not in key or not url:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAMESPACE/NAME=URL (write ns/coder=http://10.0.0.5:8080)"
        )
    return key, url.rstrip("/")


def _webhook_timeout(text: str) -> int:
    """`--webhook-timeout`'s type: whole seconds, 1 to 30 (the API server takes no other)."""
    seconds = _whole(text)
    if not 1 <= seconds <= 30:
        raise argparse.ArgumentTypeError(
            f"{seconds} is not 1 to 30: the API server waits 1 to 30 seconds for a webhook"
        )
    return seconds


def _port(text: str) -> int:
    """`--webhook-service-port`'s type: a TCP port, 1 to 65535."""
    port = _whole(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1 to 65535)")
    return port


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _service(text: str) -> str:
    """`--webhook-service`'s type: the webhook's Service as NAMESPACE/NAME (DNS labels)."""
    namespace, slash, name = text.partition("/")
    if not slash or not DNS_LABEL.fullmatch(namespace) or not DNS_LABEL.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAMESPACE/NAME of the webhook's Service (lowercase DNS "
            "labels), e.g. continuum-system/continuum-webhook"
        )
    return text


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
        None,
        "writes in flight at once: Engines' ledgers (one engine each), Minds' projections",
        type=at_least_one("a count of writes in flight (1 or more)"),
        default=GrantSettings().write_workers,
    ),
    SettingFlag(
        "--engine-address",
        None,  # grant_settings makes the map of the checked pairs
        "where minds reach an Engine's gateway instead of its Service (repeatable)",
        type=_engine_address,
        default=[],
        action="append",
        metavar="NS/NAME=URL",
    ),
)


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


#: The flags that set ChildrenSettings, in the order `--help` shows them.
_CHILDREN_FLAGS = (
    SettingFlag(
        "--children-priority-class",
        None,  # a field of PodSettings: `cli.operator.settings_from` sets it
        "PriorityClass of a mind's child pods (installed by the operator)",
        default=PodSettings().children_priority_class,
    ),
    SettingFlag(
        "--webhook",
        "webhook",
        "serve the children's mutating webhook and install its configuration",
        action="store_true",
    ),
    SettingFlag("--webhook-name", "webhook_name", "its configuration's name"),
    SettingFlag("--webhook-listen", "listen", "address the webhook listens on"),
    SettingFlag("--webhook-port", "port", "port the webhook listens on", type=int),
    SettingFlag("--webhook-host", "host", "host or IP the API server calls the webhook at"),
    SettingFlag(
        "--webhook-service",
        None,  # children_settings sets `service` to its (namespace, name)
        "the Service in front of the webhook: the configuration names it instead of a URL "
        "(the API server then needs no cluster DNS); its certificate must name "
        "NAME.NAMESPACE.svc (give that as --webhook-host for a self-signed one)",
        type=_service,
        default=None,
        metavar="NAMESPACE/NAME",
    ),
    SettingFlag(
        "--webhook-service-port",
        "service_port",
        "the Service's port for the webhook (default: --webhook-port)",
        type=_port,
    ),
    SettingFlag("--webhook-certfile", "certfile", "serving certificate (default: self-signed)"),
    SettingFlag("--webhook-keyfile", "keyfile", "its private key"),
    SettingFlag("--webhook-cafile", "cafile", "CA bundle for the API server (cert-manager ca.crt)"),
    SettingFlag(
        "--webhook-timeout",
        "timeout_seconds",
        "seconds the API server waits before admitting a child unmutated (1-30)",
        type=_webhook_timeout,
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The children's webhook's, then the grants' and the leader's flags (`--help`'s order)."""
    add_flags(p, _CHILDREN_FLAGS, ChildrenSettings())
    add_flags(p, _GRANT_FLAGS, GrantSettings())
    add_flags(p, _leader_flags(), LeaderSettings())


def refusal(args: argparse.Namespace) -> str | None:
    """What is wrong between two of these flags, and what to give instead; None: nothing.
    (Each flag's own value was checked as it was parsed.)"""
    if (args.webhook_certfile is None) != (args.webhook_keyfile is None):
        return (
            "--webhook-certfile and --webhook-keyfile go together: give both (the serving "
            "certificate and its key) or neither (a self-signed one)"
        )
    settings = settings_from_flags(LeaderSettings(), _leader_flags(), args)
    deadline = settings.duration_seconds - settings.margin_seconds
    if settings.enabled and settings.renew_seconds >= deadline:
        return (
            f"--leader-renew {settings.renew_seconds:g} must be shorter than "
            f"--leader-lease-duration {settings.duration_seconds:g} less the leader's margin of "
            f"{settings.margin_seconds:g} s (under {deadline:g} s): the leader would stop leading "
            "between two of its own renewals and a standby could take the Lease; renew more "
            "often or lengthen the Lease (the defaults: 2 and 15)"
        )
    return None


def grant_settings(args: argparse.Namespace) -> GrantSettings:
    return replace(
        settings_from_flags(GrantSettings(), _GRANT_FLAGS, args),
        engine_addresses=dict(args.engine_address),
        write_workers=args.write_workers,
    )


def leader_settings(args: argparse.Namespace, engine_labels: Mapping[str, str]) -> LeaderSettings:
    """The leader's settings (`refusal` found nothing wrong). The Lease is named by
    --leader-lease, else the default name with the digest of the Engines' selector: operators
    serving different Engines are different groups."""
    name = args.leader_lease or LeaderSettings().name
    if not args.leader_lease and engine_labels:
        text = label_selector(engine_labels)
        name = f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    return replace(settings_from_flags(LeaderSettings(), _leader_flags(), args), name=name)


def children_settings(args: argparse.Namespace) -> ChildrenSettings:
    """The children's webhook's settings (`refusal` found nothing wrong)."""
    service = None
    if args.webhook_service is not None:
        namespace, _, name = str(args.webhook_service).partition("/")
        service = (namespace, name)
    return replace(settings_from_flags(ChildrenSettings(), _CHILDREN_FLAGS, args), service=service)
