"""Engine: a llama.cpp server whose KV-cache pool is shared out to minds as grants.

The spec says what to serve and how much of it (context per mind, minds min..max, offload,
KV type, reserve, placement); the plan (`core.plan`) turns it into layers on the device and a
pool size against one node's board. Status parts are written by their one writer each
(docs/design.md "One writer per status field"): `plan`, `placement`, `enforcement` and
`conditions` by the operator, `runtime` by the engine runtime. Its grant ledger is an object of
its own, `model.grant_ledger.GrantLedger`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from continuum_operator.model.base import (
    Bytes,
    Conditions,
    LabelNamedMeta,
    ObservedGeneration,
    PositiveInt,
    Resource,
    Spec,
    spec_config_with_rules,
)
from continuum_operator.model.kv import KvCacheType as KvCacheType  # re-exported: its home before
from continuum_operator.model.plan_status import EnginePoolBytes as EnginePoolBytes  # re-exported
from continuum_operator.model.plan_status import PlanStatus, plan_status_schema
from continuum_operator.model.runtime import EngineRuntimeStatus

GiB = 1024**3

# A per-layer quantity may be one number for every layer or a list, one per layer. The CRD
# cannot type a union of integer and array, so the field is left open in the schema. The API
# server refuses CEL rules on a field without a type ("unable to convert structural schema to CEL
# declarations"), so the check lives here, in pydantic, and the operator reports a bad value as
# a condition on the Engine instead of the API server refusing it.
PerLayerBytes = Annotated[
    int | list[int],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
]
# KV bytes: a model whose cells cost nothing would plan an unbounded pool on a shared GPU. The
# API server applies `minimum` to a number and ignores it for a list (an open field has no
# type), so it refuses 0 or less given as one number; a list is checked here.
KvPerLayerBytes = Annotated[
    int | list[int],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True, "minimum": 1}),
]


class ModelFacts(Spec):
    """Facts of a model's file that the plan needs: per-layer bytes and KV rates.

    Inline facts serve when no reader can see the GGUF file; `continuum facts MODEL.gguf`
    (`gguf.facts`) fills the same shape from the file's header and tensor index. Every size is
    bytes of the file's own quantisation. Only `layers`, `layerBytes`, `inputBytes` and
    `kvBytesPerTokenPerLayer` are required; the rest sharpen the compute-buffer estimate
    (`core.compute`) or let the plan explain what it does not plan (experts).
    """

    # Not PositiveInt: the bounds of an Annotated type win over a Field's, so le=4096 was lost.
    layers: int = Field(gt=0, le=4096, description="Repeating (transformer) layers.")
    layer_bytes: PerLayerBytes = Field(description="Weights of each repeating layer.")
    input_bytes: Bytes = Field(
        description="Token embeddings; always on the host, as llama.cpp keeps them."
    )
    output_bytes: Bytes = Field(
        default=0,
        description="Output head and its norm; on the device only when every repeating layer "
        "is. For a tied head (no output.weight) llama.cpp copies the token embeddings to the "
        "output layer's device, so this counts them.",
    )
    output_host_bytes: Bytes | None = Field(
        default=None,
        description="What the output layer adds on the host when it is not offloaded; defaults "
        "to outputBytes. Smaller for a tied head: the mapped file already holds the token "
        "embeddings (inputBytes), so only the output norm is added.",
    )
    kv_bytes_per_token_per_layer: KvPerLayerBytes = Field(
        description="K plus V bytes per KV cell per layer at f16; scaled by spec.kvCacheType. "
        "Layers in slidingWindowLayers hold only the window's cells (see slidingWindow)."
    )
    compute_bytes: Bytes | None = Field(
        default=None,
        description="Compute buffer at the planned context, if known; otherwise estimated.",
    )
    embedding_length: PositiveInt | None = Field(
        default=None, description="Width of the hidden state (n_embd), for the compute estimate."
    )
    head_count: PositiveInt | None = Field(default=None, description="Attention heads (n_head).")
    head_count_kv: PerLayerBytes | None = Field(
        default=None, description="KV heads, one number or one per layer."
    )
    key_length: PositiveInt | None = Field(
        default=None, description="Head size of K (attention.key_length, else n_embd/n_head)."
    )
    value_length: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="Head size of V (attention.value_length, else key length; 0 where only K "
        "is cached, as in MLA models).",
    )
    feed_forward_length: PositiveInt | None = Field(
        default=None, description="Widest feed-forward layer (the largest where it varies)."
    )
    vocab_size: PositiveInt | None = Field(
        default=None, description="Tokens in the vocabulary (the output logits' width)."
    )
    context_length: PositiveInt | None = Field(
        default=None, description="The context the model was trained for."
    )
    sliding_window: PositiveInt | None = Field(
        default=None,
        description="Sliding-window size in tokens. llama.cpp sizes the KV of those layers at "
        "the window, not the context: min(context, window x sequences + micro-batch), padded "
        "to 256 cells.",
    )
    sliding_window_layers: list[Annotated[int, Field(ge=0, le=4095)]] = Field(
        default_factory=list,
        max_length=4096,
        description="Indices of the layers that attend over the sliding window only.",
    )
    expert_count: int | None = Field(
        default=None, ge=0, le=65_536, description="Experts per MoE layer (0 or absent: dense)."
    )
    expert_used_count: int | None = Field(
        default=None, ge=0, le=65_536, description="Experts each token uses in an MoE layer."
    )
    architecture: str | None = Field(
        default=None, max_length=64, description="general.architecture of the GGUF (llama, qwen3)."
    )

    @field_validator("layer_bytes", "kv_bytes_per_token_per_layer", "head_count_kv")
    @classmethod
    def _one_size_or_one_per_layer(
        cls, value: int | list[int] | None, info: ValidationInfo
    ) -> int | list[int] | None:
        if value is None:
            return None
        if isinstance(value, list):
            for i, v in enumerate(value):
                if v < 0 or v > 2**62:
                    raise ValueError(f"entry [{i}] is {v}; sizes must be between 0 and 2^62 bytes")
        elif value < 0 or value > 2**62:
            raise ValueError("sizes must be between 0 and 2^62 bytes")
        if (
            info.field_name == "kv_bytes_per_token_per_layer"
            and (max(value, default=0) if isinstance(value, list) else value) < 1
        ):
            raise ValueError(
                f"is {value}: every KV cell costs bytes (at least one layer's rate is 1 or "
                "more); `continuum facts MODEL.gguf` reads the rates from the file"
            )
        layers = info.data.get("layers")
        if isinstance(value, list) and layers is not None and len(value) != layers:
            raise ValueError(
                f"lists {len(value)} layers but layers is {layers}; "
                "give one number for all layers or one per layer"
            )
        return value

    @model_validator(mode="after")
    def _window_layers_exist(self) -> Self:
        outside = [i for i in self.sliding_window_layers if i >= self.layers]
        if outside:
            raise ValueError(
                f"slidingWindowLayers lists layer {outside[0]} but the model has {self.layers}"
            )
        if self.sliding_window_layers and self.sliding_window is None:
            raise ValueError("slidingWindowLayers is set but slidingWindow is not")
        return self

    @property
    def output_host(self) -> int:
        """Bytes the output layer adds on the host when it stays there."""
        return self.output_bytes if self.output_host_bytes is None else self.output_host_bytes

    @property
    def is_moe(self) -> bool:
        return (self.expert_count or 0) > 1

    def layer_bytes_list(self) -> list[int]:
        return _per_layer(self.layer_bytes, self.layers)

    def kv_f16_list(self) -> list[int]:
        return _per_layer(self.kv_bytes_per_token_per_layer, self.layers)


def _per_layer(value: int | list[int], layers: int) -> list[int]:
    return list(value) if isinstance(value, list) else [value] * layers


class ModelSourceKind(StrEnum):
    """Where the file is: `pvc` (a PersistentVolumeClaim), `hostPath` (a path on the node) or
    `image` (an image volume)."""

    PVC = "pvc"
    HOST_PATH = "hostPath"
    IMAGE = "image"


# A path with a `..` segment climbs out of what a hostPath or image volume names.
_CLIMBS = r"(^|/)[.][.](/|$)"  # [.], not \.: the pattern is also a CEL string literal


class ModelSource(Spec):
    """Where the model's GGUF file is; the engine pod mounts it read-only and a short Job on the
    node reads its facts when spec.model.facts is absent."""

    model_config = spec_config_with_rules(
        {
            "rule": "self.kind != 'pvc' || has(self.claimName)",
            "message": "a pvc source names its PersistentVolumeClaim in claimName",
        },
        {
            "rule": "self.kind != 'image' || has(self.image)",
            "message": "an image source names its image reference in image",
        },
        {
            "rule": "self.kind != 'hostPath' || self.path.startsWith('/')",
            "message": "a hostPath source's path is absolute (/models/model.gguf)",
        },
        {
            "rule": f"!self.path.matches('{_CLIMBS}')",
            "message": "path has a '..' segment; name the file's own directory",
        },
    )

    kind: ModelSourceKind
    claim_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The PersistentVolumeClaim holding the file, in the Engine's namespace (pvc).",
    )
    # No control characters: the path ends up in a container's arguments and a volume.
    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="Path of the GGUF file in the source.",
    )
    # An image reference (registry/name:tag@digest), not a command line: no spaces or quotes.
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        pattern=r"^[a-zA-Z0-9][-a-zA-Z0-9._/:]*(@sha256:[0-9a-f]{64})?$",
        description="The image holding the file, mounted as an image volume (image).",
    )

    @model_validator(mode="after")
    def _source_is_whole(self) -> Self:
        if self.kind is ModelSourceKind.PVC and self.claim_name is None:
            raise ValueError("a pvc source names its PersistentVolumeClaim in claimName")
        if self.kind is ModelSourceKind.IMAGE and self.image is None:
            raise ValueError("an image source names its image reference in image")
        if self.kind is ModelSourceKind.HOST_PATH and not self.path.startswith("/"):
            raise ValueError("a hostPath source's path is absolute (/models/model.gguf)")
        if re.search(_CLIMBS, self.path):
            raise ValueError("path has a '..' segment; name the file's own directory")
        return self


class ModelRef(Spec):
    """The model: its file's source and digest, or its facts inline (at least one of the two)."""

    model_config = spec_config_with_rules(
        {
            "rule": "has(self.facts) || has(self.source)",
            "message": "give the model's facts inline, or a source to read them from",
        },
    )

    source: ModelSource | None = None
    sha256: str | None = Field(
        default=None,
        pattern="^[0-9a-f]{64}$",
        description="The file's sha256 (`continuum facts MODEL.gguf --sha256`): checked before "
        "the first launch, and the key of its receipts; without it no receipt is used.",
    )
    facts: ModelFacts | None = Field(
        default=None,
        description="The model's facts inline (`continuum facts MODEL.gguf` prints them), for "
        "when no reader can see the file; planned from as given.",
    )

    @model_validator(mode="after")
    def _facts_or_source(self) -> Self:
        if self.facts is None and self.source is None:
            raise ValueError("give the model's `facts` inline, or a `source` to read them from")
        return self


class Minds(Spec):
    """How many minds the engine serves at once: one slot each."""

    model_config = spec_config_with_rules(
        {"rule": "self.min <= self.max", "message": "minds.min must not exceed minds.max"},
    )

    min: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Slots the plan must hold: it puts the most layers on the device that still "
        "leave room for this many contexts; a node that cannot is not chosen.",
    )
    max: int = Field(
        default=1, ge=1, le=4096, description="The most slots: the pool grows toward it."
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


OffloadWord = Literal["auto", "all", "none"]


class ParkTier(StrEnum):
    """Where an engine's park store lives (docs/gateway.md, "A turn cut off")."""

    HOST = "host"  # host memory: on a unified node, the one pool the device also draws on
    DISK = "disk"  # the node's disk, as its agent probes it


class ParkBudget(Spec):
    """The engine's park store: reclaimed minds' contexts saved by llama-server and restored
    at their next grant, charged to its tier like any other lease; a full store evicts the
    least recently parked context first."""

    tier: ParkTier = Field(
        default=ParkTier.HOST,
        description="host (host memory; on a unified node the one pool) or disk (the node's "
        "disk, as its agent probes it).",
    )
    bytes: Bytes = Field(
        description="The store's size: the plan charges it to the tier, a park that does not "
        "fit evicts the oldest, and a context larger than it is erased, not parked."
    )


# Kubernetes label syntax: the engine's pod and its facts Job carry these as a nodeSelector,
# which the API server would refuse (a 422 on every pass) for anything else.
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]


class Placement(Spec):
    """Which nodes may run the engine, and how many GPUs it takes there."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels the engine's node must carry (label keys and values).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k.size() <= 317 && k.matches('{LABEL_KEY}'))",
                    "message": "nodeSelector keys are label keys: [prefix/]name, the name at "
                    "most 63 letters, digits, '-', '_' or '.', starting and ending with a "
                    "letter or digit",
                }
            ]
        },
    )
    node_pool: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE,
        description="The node pool: a value of the nodes' continuum.dev/node-pool label.",
    )
    gpus: int = Field(default=1, ge=1, le=64, description="GPUs for one engine, split evenly.")
    device_budget_bytes: Bytes | None = Field(
        default=None,
        description="Declared device budget, used only where the node's memory mode is unknown.",
    )

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if len(key) > 317 or not re.match(LABEL_KEY, key):
                raise ValueError(
                    f"key {key[:60]!r} is not a label key: [prefix/]name, the name at most 63 "
                    "letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
                )
        return value


class EngineSpec(Spec):
    """What to serve and how much of it: the plan (`continuum plan`) turns it into layers on the
    device and a KV pool on one node (docs/plan.md)."""

    model: ModelRef
    context_tokens_per_mind: int = Field(
        ge=16,
        le=16_777_216,
        description="Context of one slot, in tokens: every mind's grant is at most this.",
    )
    minds: Minds = Field(default_factory=Minds)
    offload: OffloadWord | Annotated[int, Field(ge=0, le=4097)] = Field(
        default="auto",
        description="Layers on the device: auto (the most that fit), all, none, or a number.",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self >= 0 : self in ['auto', 'all', 'none']",
                    "message": "offload is auto, all, none or a number of layers",
                }
            ],
        },
    )
    kv_cache_type: KvCacheType = Field(
        default=KvCacheType.F16,
        description="Type of the KV cache's cells (llama.cpp --cache-type-k/-v): f32, f16, "
        "q8_0 or q4_0; the quantised types hold more tokens in the same bytes.",
    )
    reserve_bytes: Bytes = Field(default=GiB, description="Kept free in each pool the engine uses.")
    placement: Placement = Field(
        default_factory=Placement, description="Which nodes may run the engine, on how many GPUs."
    )
    park: ParkBudget | None = Field(
        default=None,
        description="Where a reclaimed mind's context is parked until her next grant, and how "
        "much the store holds; absent: a reclaim erases her context.",
    )
    allowed_namespaces: list[
        Annotated[str, Field(max_length=63, pattern=r"^([*]|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$")]
    ] = Field(
        default_factory=list,
        max_length=1024,
        description="Namespaces whose Minds may draw on this engine besides its own; '*': "
        "every namespace. Minds of others get no grant (EngineNotAllowed, docs/tenancy.md).",
    )


class EnginePlacement(Spec):
    """The assumed lease: node and bytes per pool, written before the pod exists."""

    node: str = Field(min_length=1, max_length=253, description="The node chosen.")
    gpus: list[int] = Field(default_factory=list, description="GPU indices on it.")
    pools: list[EnginePoolBytes] = Field(
        default_factory=list, description="Bytes leased per pool, from the plan."
    )
    assumed: bool = Field(default=True, description="True until the engine's pod runs on the node.")
    assumed_at: str | None = Field(
        default=None,
        description="When the lease was assumed; released if the pod is not ready in time.",
    )


class EngineRelaunches(Spec):
    """Relaunches of the engine's pod the operator decided (damped: docs/design.md's lessons)."""

    count: int = Field(default=0, ge=0, description="Relaunches so far.")
    last_time: str | None = Field(default=None, description="When the last began (RFC 3339).")
    last_reason: str = Field(default="", description="Why the last one was decided.")


class ReadFacts(Spec):
    """Facts the operator's facts Job read from the model file, where spec.model.facts is absent."""

    source: str = Field(max_length=8192, description="The file read: source kind, where, digest.")
    facts: ModelFacts
    read_at: str | None = Field(default=None, description="When the Job read them (RFC 3339).")


_PLAN_DESCRIPTION = (
    "The serving plan on the chosen node: bytes per pool, layers on the device, pool tokens, "
    "minds grantable, and why (`continuum plan -o json`; docs/plan.md)."
)


def _plan_schema(schema: dict[str, Any]) -> None:
    """The CRD's `status.plan`: the plan's JSON Schema (`model.plan_status`), in place of the
    schema pydantic writes for the model (the same fields, with the schema's descriptions and
    bounds: one document for `continuum plan -o json` and the CRD)."""
    schema.clear()
    schema.update(plan_status_schema(_PLAN_DESCRIPTION))


class EngineEnforcement(Spec):
    """The per-process caps applied to the engine's pod and their numbers
    (`kube.workloads.engine_objects.enforcement`), written by the operator with the pod it makes."""

    engine_args: bool = Field(description="The plan's arguments bound llama-server's buffers.")
    memory_limit_bytes: Bytes = Field(description="The container's memory limit (host bytes).")
    qos_class: str = Field(max_length=32, description="The pod's QoS class.")
    gpu_sharing: str = Field(
        max_length=16,
        description="How device bytes are enforced beyond the arguments: none, "
        "hami, mps or auto (the operator's --gpu-sharing).",
    )
    gpus: int = Field(ge=0, le=64, description="GPUs the pod asks for.")
    hami_gpumem_mib: int | None = Field(
        default=None,
        ge=0,
        alias="hamiGpumemMiB",
        description="hami: nvidia.com/gpumem asked per GPU, in MiB.",
    )
    mps_pinned_device_mem_limit: str | None = Field(
        default=None,
        max_length=1024,
        description="mps: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT set in the engine's environment.",
    )


class EngineStatus(Spec):
    """What the operator decided for the engine and what the running engine reports; each part
    has one writer (docs/design.md, "One writer per status field")."""

    # The CRD types it with the plan's own JSON Schema (`model.plan_status`), which the
    # model's fields follow (tests/unit/model/test_plan_status_model.py).
    plan: PlanStatus | None = Field(
        default=None,
        description=_PLAN_DESCRIPTION,
        json_schema_extra=_plan_schema,
    )
    placement: EnginePlacement | None = None
    enforcement: EngineEnforcement | None = None
    runtime: EngineRuntimeStatus | None = Field(
        default=None,
        description="What the engine runtime reports: receipts, layers actually offloaded, "
        "GPU offload support, slot releases (docs/receipts.md, docs/gateway.md).",
    )
    relaunches: EngineRelaunches | None = None
    model_facts: ReadFacts | None = None
    conditions: Conditions = Field(
        default_factory=list,
        description="Planned, Ready, Degraded, MemoryModeUnknown, BoardStale, Unschedulable, "
        "ReceiptRefused and PlanHeld, each always present.",
    )
    observed_generation: ObservedGeneration = None


class Engine(Resource):
    """A llama.cpp server on one node whose KV-cache pool is shared out to Minds as grants.

    The operator places it, plans it and runs it as a Deployment; `kubectl get engines` shows
    where it runs and why it is (not) ready (docs/operator.md)."""

    KIND = "Engine"
    PLURAL = "engines"
    SHORT_NAMES = ("eng",)
    # `kubectl get engines` tells the story: where it runs, what the plan buys, whether it is
    # ready, and if not, why (the Ready condition's reason: PodPending, Relaunching,
    # NoFreshBoard, InsufficientMemory, InvalidSpec...).
    PRINTER_COLUMNS = (
        {"name": "Node", "type": "string", "jsonPath": ".status.placement.node"},
        {"name": "Mode", "type": "string", "jsonPath": ".status.plan.memoryMode"},
        {"name": "Layers", "type": "integer", "jsonPath": ".status.plan.layersOnDevice"},
        {"name": "Of", "type": "integer", "jsonPath": ".status.plan.totalLayers", "priority": 1},
        {"name": "Minds", "type": "integer", "jsonPath": ".status.plan.mindsGrantable"},
        {"name": "Pool-Tokens", "type": "integer", "jsonPath": ".status.plan.poolTokens"},
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
        },
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": ".status.conditions[?(@.type=='Ready')].reason",
        },
        {
            "name": "Relaunches",
            "type": "integer",
            "jsonPath": ".status.relaunches.count",
            "priority": 1,
        },
    )

    kind: Literal["Engine"] = "Engine"
    metadata: LabelNamedMeta  # its Service, ServiceAccount and labels carry the name
    spec: EngineSpec
    status: EngineStatus = Field(default_factory=EngineStatus)
