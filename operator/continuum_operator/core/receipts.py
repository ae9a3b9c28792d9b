"""Receipts: what llama.cpp actually allocated, per device, and the key they are filed under.

docs/design.md rule 5: estimates are checked against receipts. A receipt records the model buffers,
KV buffers, compute buffers and output buffer llama.cpp reported for one load, per device (the
buffer-type names in its log: `CPU`, `CPU_Mapped`, `CUDA0`, `CUDA_Host`, `MTL0`, ...), and the
key it is filed under: (model sha256, context, KV type, placement, llama.cpp build), plus the
launch settings that also change the numbers (parallel sequences, micro-batch, flash
attention). A replaced model file, another build or another placement never inherits a receipt.

`parse_llama_log` is pure string parsing of llama.cpp's log; the engine runtime (and the
benchmarks) capture the log and call it. Receipt files (`continuum plan --receipt`) are YAML or
JSON documents of the `Receipt` model; docs/receipts.md describes them.

Neighbours: `core.plan` looks a receipt up for each placement it weighs (`ReceiptBook`);
`core.compute` is the estimate a receipt replaces.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from continuum_operator.model.kv import KvCacheType
from continuum_operator.model.receipt import (
    BufferKind,
    Receipt,
    ReceiptBuffer,
    ReceiptKey,
    ReceiptPlacement,
    is_host_buffer,
)

__all__ = [
    "LOG_RESOLUTION_BYTES",
    "BufferKind",
    "LlamaLogBuffers",
    "Receipt",
    "ReceiptBook",
    "ReceiptBuffer",
    "ReceiptKey",
    "ReceiptPlacement",
    "is_host_buffer",
    "parse_llama_log",
    "read_for_receipt",
]

MIB = 1 << 20
#: llama.cpp prints sizes in MiB with two decimals: a printed size is within this of the truth.
LOG_RESOLUTION_BYTES = math.ceil(0.005 * MIB)


@dataclass(frozen=True, slots=True)
class ReceiptBook:
    """Receipts indexed by key; the build may be left open when the caller does not know it.

    With `llama_build` None a receipt of any build matches, and among several the one whose
    build sorts last wins (deterministic; the plan names the build it used).
    """

    receipts: tuple[Receipt, ...] = ()
    llama_build: str | None = None

    def find(
        self,
        *,
        model_sha256: str | None,
        context_tokens: int,
        kv_cache_type: KvCacheType,
        layers_on_device: int,
        gpus: int,
        parallel: int,
        micro_batch_tokens: int = 512,
        flash_attention: bool = True,
    ) -> Receipt | None:
        if model_sha256 is None or not self.receipts:
            return None
        gpus_used = gpus if layers_on_device > 0 else 0
        found = [
            r
            for r in self.receipts
            if r.model_sha256 == model_sha256
            and r.context_tokens == context_tokens
            and r.kv_cache_type is kv_cache_type
            and r.placement.layers_on_device == layers_on_device
            and r.placement.gpus == gpus_used
            and r.parallel == parallel
            and r.micro_batch_tokens == micro_batch_tokens
            and r.flash_attention == flash_attention
            and (self.llama_build is None or r.llama_build == self.llama_build)
            and r.complete  # never a receipt that would charge a part nothing
        ]
        return max(found, key=lambda r: r.llama_build) if found else None


# --- llama.cpp's log -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LlamaLogBuffers:
    """What one load's log says: buffers per device and the settings that sized them."""

    buffers: tuple[ReceiptBuffer, ...]
    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_seq_max: int | None = None
    n_ubatch: int | None = None
    flash_attention: bool | None = None
    kv_type_k: str | None = None
    kv_type_v: str | None = None
    layers_offloaded: int | None = None
    layers_total: int | None = None
    build: str | None = None

    def receipt(
        self,
        *,
        model_sha256: str,
        context_tokens: int,
        llama_build: str | None = None,
        gpus: int = 0,
        source: str = "",
    ) -> Receipt:
        """File these buffers under a key; the log supplies what it knows of the settings."""
        build = llama_build or self.build
        if build is None:
            raise ValueError("the log names no llama.cpp build; pass llama_build")
        layers = self.layers_offloaded or 0
        receipt = Receipt(
            model_sha256=model_sha256,
            context_tokens=context_tokens,
            kv_cache_type=KvCacheType(self.kv_type_k or "f16"),
            placement=ReceiptPlacement(layers_on_device=layers, gpus=gpus if layers else 0),
            llama_build=build,
            parallel=self.n_seq_max or 1,
            micro_batch_tokens=self.n_ubatch or 512,
            flash_attention=bool(self.flash_attention),
            buffers=list(self.buffers),
            source=source,
        )
        if not receipt.complete:
            named = ", ".join(sorted({b.kind.value for b in self.buffers})) or "none"
            raise ValueError(
                "the log names no model, KV (or recurrent state) and compute buffers together "
                f"(it names: {named}); cut short before the load ended?"
            )
        return receipt


_SIZE = r"=\s*([0-9]+(?:\.[0-9]+)?) MiB"
_BUFFER_LINES: Sequence[tuple[BufferKind, re.Pattern[str]]] = (
    (BufferKind.MODEL, re.compile(r"^load_tensors:\s+(\S+) model buffer size\s*" + _SIZE)),
    (BufferKind.KV, re.compile(r"^llama_kv_cache(?:_\w+)?:\s+(\S+) KV buffer size\s*" + _SIZE)),
    (BufferKind.OUTPUT, re.compile(r"^llama_context:\s+(\S+)\s+output buffer size\s*" + _SIZE)),
    (BufferKind.RECURRENT, re.compile(r"^llama_memory_recurrent:\s+(\S+) RS buffer size\s*"
                                      + _SIZE)),
    (BufferKind.COMPUTE, re.compile(r"^(?:sched_reserve|llama_context|graph_reserve):\s+(\S+) "
                                    r"compute buffer size\s*" + _SIZE)),
)  # fmt: skip
_SETTINGS = {
    "n_ctx": re.compile(r"^llama_context: n_ctx\s*=\s*(\d+)"),
    "n_ctx_seq": re.compile(r"^llama_context: n_ctx_seq\s*=\s*(\d+)"),
    "n_seq_max": re.compile(r"^llama_context: n_seq_max\s*=\s*(\d+)"),
    "n_ubatch": re.compile(r"^llama_context: n_ubatch\s*=\s*(\d+)"),
}
_FLASH = re.compile(r"^llama_context: flash_attn\s*=\s*(\S+)")
_KV_TYPES = re.compile(r"^llama_kv_cache: size = .* K \((\w+)\):.* V \((\w+)\):")
_OFFLOADED = re.compile(r"^load_tensors: offloaded (\d+)/(\d+) layers to GPU")
# "build: 6869 (1a2b3c4d) with ..." in older logs; llama-server's own line (at -lv 4) reads
# "cmn  common_param: common_params_print_info: build 1 (0c1e57098) with ...". Searched, not
# matched, so any prefix before the word serves.
_BUILD = re.compile(r"(?<![\w-])build(?: info)?:?\s*=?\s*(\d+ \([0-9a-f]+\))")


#: The patterns `parse_llama_log` matches each line with (after any timestamp); `_BUILD` is
#: searched. One list with the parser's, so what is kept and what is read cannot drift apart.
_READ = (*(p for _, p in _BUFFER_LINES), *_SETTINGS.values(), _FLASH, _KV_TYPES, _OFFLOADED)


def read_for_receipt(line: str) -> bool:
    """Whether `parse_llama_log` reads this line: a runtime keeps only those of a load, so that
    a model of many metadata keys (a line each, before the buffers) cannot push the buffers
    past what it keeps."""
    stripped = _strip_prefix(line)
    return any(p.match(stripped) for p in _READ) or llama_build_of(stripped) is not None


def parse_llama_log(text: str | Iterable[str]) -> LlamaLogBuffers:
    """The buffers of one model load in llama.cpp's log (text, or its lines).

    Model and KV buffers of the same device add up (an interleaved sliding-window model logs
    two KV caches). Compute buffers are reserved again when llama.cpp re-plans its graph (flash
    attention `auto`, a changed batch): the last reservation per device counts. Leading
    timestamps and log-level prefixes (`I `, `0.00.123.456 I `) are ignored.
    """
    lines = text.splitlines() if isinstance(text, str) else list(text)
    summed: dict[tuple[BufferKind, str], int] = {}
    last: dict[tuple[BufferKind, str], int] = {}
    order: list[tuple[BufferKind, str]] = []
    settings: dict[str, int] = {}
    flash: bool | None = None
    kv_k = kv_v = None
    offloaded = total_layers = None
    build = None
    for raw in lines:
        line = _strip_prefix(raw)
        for kind, pattern in _BUFFER_LINES:
            m = pattern.match(line)
            if m:
                key = (kind, m.group(1))
                size = round(float(m.group(2)) * MIB)
                if key not in summed and key not in last:
                    order.append(key)
                if kind in (BufferKind.COMPUTE, BufferKind.OUTPUT):
                    last[key] = size
                else:
                    summed[key] = summed.get(key, 0) + size
                break
        else:
            for name, pattern in _SETTINGS.items():
                m = pattern.match(line)
                if m:
                    settings[name] = int(m.group(1))
            if m := _FLASH.match(line):
                flash = m.group(1).lower() in ("1", "true", "enabled", "on")
            elif m := _KV_TYPES.match(line):
                kv_k, kv_v = m.group(1), m.group(2)
            elif m := _OFFLOADED.match(line):
                offloaded, total_layers = int(m.group(1)), int(m.group(2))
            elif build is None and (found := llama_build_of(line)):
                build = found
    buffers = tuple(
        ReceiptBuffer(device=device, kind=kind, bytes=summed.get((kind, device), 0)
                      + last.get((kind, device), 0))
        for kind, device in order
    )  # fmt: skip
    return LlamaLogBuffers(
        buffers=buffers,
        n_ctx=settings.get("n_ctx"),
        n_ctx_seq=settings.get("n_ctx_seq"),
        n_seq_max=settings.get("n_seq_max"),
        n_ubatch=settings.get("n_ubatch"),
        flash_attention=flash,
        kv_type_k=kv_k,
        kv_type_v=kv_v,
        layers_offloaded=offloaded,
        layers_total=total_layers,
        build=build,
    )


_PREFIX = re.compile(r"^(?:\d+\.\d+\.\d+\.\d+ )?(?:[DIWE] )?")


def llama_build_of(text: str) -> str | None:
    """The llama.cpp build a log (or a line of it) names, as receipts file it: "6869 (1a2b)"."""
    m = _BUILD.search(text)
    return m.group(1) if m else None


def _strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line.strip(), count=1)
