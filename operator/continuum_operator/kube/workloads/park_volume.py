"""The engine pod's park store (spec.park; docs/gateway.md, "A turn cut off"): its volume and
the runtime's arguments that name it."""

from __future__ import annotations

from continuum_operator.model.engine import Engine, ParkTier

__all__ = ["PARK_DIR", "park_args", "park_volume"]

#: The park store's directory in the engine's container (llama-server's --slot-save-path).
PARK_DIR = "/park"

MiB = 2**20


def park_args(engine: Engine) -> list[str]:
    """`continuum engine`'s park arguments: none where the Engine parks nothing."""
    park = engine.spec.park
    if park is None:
        return []
    return ["--park-dir", PARK_DIR, "--park-budget", str(park.bytes)]


def park_volume(engine: Engine) -> tuple[dict[str, object], dict[str, str]] | None:
    """The park store's volume and mount: an emptyDir of spec.park.bytes, in memory (tier host,
    counted in the pod's memory limit as the plan counts it) or on the node's disk."""
    park = engine.spec.park
    if park is None:
        return None
    empty = {"sizeLimit": f"{-(-park.bytes // MiB)}Mi"}
    if park.tier is ParkTier.HOST:
        empty["medium"] = "Memory"
    return {"name": "park", "emptyDir": empty}, {"name": "park", "mountPath": PARK_DIR}
