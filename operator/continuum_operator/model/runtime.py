"""What the runtimes report in `status.runtime`: the engine runtime on its Engine
(`engine.runtime.runtime_status`), the lane runtime on its EmbedLane (`embed.runtime`), each
the one writer of its part (docs/design.md "One writer per status field").

Typed so the API server keeps what they write and `kubectl explain` says what it means. A
structural schema prunes a field it does not name, silently: every key a writer writes is a
field here (tests/unit/kube/engines/test_status_writers.py builds each document with its writer's
own code and reads it with these models, unknown keys refused). A writer writes None for what it
does not know (the document is a merge patch, where a key left out would keep its old value): those
fields are nullable. No defaults in the schema: the API server would write them into stored objects.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from continuum_operator.model.base import Bytes, Spec, nullable
from continuum_operator.model.receipt import Receipt

__all__ = [
    "EngineRuntimeStatus",
    "EstimateError",
    "LaneRefusal",
    "LaneRequests",
    "LaneRuntimeStatus",
    "ModelFileRecord",
    "ParkStoreStatus",
    "ParkedMind",
    "RuntimeExit",
    "SlotReleaseStatus",
]

Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Tokens = Annotated[int, Field(ge=0, le=16_777_216)]
Receipts = Annotated[list[Receipt], Field(max_length=64)]


class EstimateError(Spec):
    """The plan's bytes on one side against what llama.cpp allocated (docs/design.md rule 5)."""

    pool: str = Field(max_length=64, description="device or host.")
    planned_bytes: Bytes = Field(description="Weights, KV and compute the plan put there.")
    allocated_bytes: Bytes = Field(description="What llama.cpp allocated there.")
    ratio: float = Field(description="(planned - allocated) / allocated.")


class SlotReleaseStatus(Spec):
    """A reclaimed slot the gateway cut, erased and reports released: the operator frees the
    mind's grant when it names her reclaim (mind, slot, grantSince)."""

    mind: str = Field(max_length=512, description="The mind whose slot it was.")
    slot: int = Field(ge=0, description="The slot.")
    reason: str = Field(max_length=64, description="Why it was reclaimed, as her entry said.")
    grant_since: str | None = nullable("The reclaim's `since` in the ledger (RFC 3339).")
    at: str = Field(max_length=64, description="When the slot was released (RFC 3339).")
    erased_tokens: int | None = nullable(
        "Tokens of her context erased from the slot; null: not erased when released (her park "
        "is saved behind the release, or llama-server had not erased it by the deadline): the "
        "gateway erases it before its next holder's first request."
    )
    parked_tokens: Tokens | None = nullable(
        "Tokens of her context saved to the park store before the erase (0: not parked); "
        "null: the save runs behind the release (filled in when it ends, if still reported)."
    )
    not_parked: str | None = nullable(
        "Why her context was erased without a park: NoStore, Empty, SizeUnknown, TooLarge, "
        "NoTime (the save could not finish before the reclaim's deadline) or SaveFailed."
    )


class ParkedMind(Spec):
    """One mind's context in the engine's park store."""

    mind: str = Field(max_length=512, description="The mind it was saved from.")
    tokens: Tokens = Field(description="Tokens of her context.")
    bytes: Bytes = Field(description="Bytes of the store it takes.")


class ParkStoreStatus(Spec):
    """The engine's park store: reclaimed minds' contexts, restored at their next grant
    (docs/gateway.md, "A turn cut off")."""

    budget_bytes: Bytes = Field(description="The Engine's park budget.")
    parked_bytes: Bytes = Field(description="Bytes parked now.")
    parked_contexts: Count = Field(description="Contexts parked now.")
    minds: Annotated[list[ParkedMind], Field(max_length=4096)] = Field(
        description="Each parked context, oldest first (evicted first when the store is full)."
    )
    idle: Annotated[list[Annotated[str, Field(max_length=512)]], Field(max_length=4096)] = Field(
        description="Minds that parked themselves idle (POST /v1/park) and have asked nothing "
        "since: the operator gives their slots to minds waiting (reason Parked)."
    )


class RuntimeExit(Spec):
    """llama-server's last exit."""

    code: int = Field(description="Its exit code (negative: the signal that ended it).")
    at: str = Field(max_length=64, description="When (RFC 3339).")
    line: str = Field(max_length=1024, description="The line of its output that says why.")


class ModelFileRecord(Spec):
    """The model file as the runtime checked it against spec.model.sha256 (`engine.digest`): a
    restarted runtime skips hashing a file whose size, times and inode are unchanged."""

    path: str = Field(max_length=4096, description="The file, in the container.")
    sha256: str = Field(max_length=64, description="Its digest.")
    node: str | None = nullable("The node it was hashed on.")
    size_bytes: Bytes = Field(description="Its size.")
    mtime_ns: str = Field(max_length=32, description="Its mtime in ns (a string: beyond 2^53).")
    ctime_ns: str = Field(max_length=32, description="Its ctime in ns.")
    inode: str = Field(max_length=32, description="Its inode.")
    verdict: str = Field(
        max_length=32, description="Hashed, Skipped (the same file as verified before) or Mismatch."
    )


class EngineRuntimeStatus(Spec):
    """What the engine runtime reports (docs/gateway.md, "What the runtime reports"): where
    llama-server is in its life, the receipt of its load, the layers it offloaded, the estimate
    error per side, and the slot releases the gateway made. Every field is written, null where
    unknown."""

    phase: str | None = nullable(
        "VerifyingModel, ModelMismatch, Starting, Serving, Restarting or Stopped."
    )
    ready: bool | None = nullable("Loaded and answering, with a receipt made.")
    restarts: Count | None = nullable("Restarts of llama-server by this runtime.")
    llama_build: str | None = nullable("The llama.cpp build it runs, as receipts file it.")
    slots: Count | None = nullable("Slots llama-server has (its /slots).")
    slot_tokens: Tokens | None = nullable("Context of one slot, in tokens.")
    layers_offloaded: Count | None = nullable("Layers llama.cpp offloaded to the device.")
    layers_total: Count | None = nullable("Layers of the model, as llama.cpp counts them.")
    gpu_offload: bool | None = nullable("Whether this llama.cpp could offload to a device.")
    receipts: Receipts | None = nullable(
        "The receipt of the load (docs/receipts.md): what llama.cpp allocated, per buffer."
    )
    estimate_error: Annotated[list[EstimateError], Field(max_length=8)] | None = nullable(
        "The plan's bytes per side against the receipt."
    )
    slot_releases: Annotated[list[SlotReleaseStatus], Field(max_length=4096)] | None = nullable(
        "Reclaimed slots the gateway released (docs/gateway.md)."
    )
    threads: Count | None = nullable("--threads given to llama-server (null: its default).")
    last_exit: RuntimeExit | None = nullable("llama-server's last exit.")
    message: str | None = nullable("Why it does not serve (a model mismatch, a stop).")
    model_file: ModelFileRecord | None = nullable("The model file as checked.")
    launch: str | None = nullable("The pod's launch, as the operator named it.")
    park: ParkStoreStatus | None = nullable("The park store (null: the Engine parks nothing).")


class LaneRequests(Spec):
    """Embedding requests since the lane runtime started."""

    served: Count = Field(description="Answered.")
    waited: Count = Field(description="Answered after waiting for room.")
    refused: Count = Field(description="Refused.")


class LaneRefusal(Spec):
    """The last request the lane refused."""

    reason: str = Field(max_length=64, description="Why, as one CamelCase word.")
    message: str = Field(max_length=4096, description="Why, in words.")
    tokens: int = Field(ge=0, description="Tokens it asked to embed.")


class LaneRuntimeStatus(Spec):
    """What the lane runtime reports: its context, the largest it embedded (its floor), its
    receipts and requests (docs/embedlanes.md)."""

    phase: str | None = nullable("Calibrating or Serving.")
    ready: bool | None = nullable("Serving.")
    gpu_offload: bool | None = nullable("Whether its llama.cpp can offload to a GPU.")
    llama_build: str | None = nullable("The build receipts are filed under.")
    max_context_tokens: Tokens | None = nullable("spec.maxContextTokens, as the runtime read it.")
    leased_context_tokens: Tokens | None = nullable("The context its placement leases.")
    context_tokens: Tokens | None = nullable("Cells of its context now.")
    largest_context_tokens: Tokens | None = nullable(
        "The largest context embedded: the floor no reclaim goes below."
    )
    receipts: Receipts | None = nullable("Receipts of its contexts, by size (docs/receipts.md).")
    requests: LaneRequests | None = nullable("Requests since it started.")
    last_refusal: LaneRefusal | None = nullable("The last request refused.")
