"""Receipt files: YAML or JSON documents of `core.receipts.Receipt`, read for `--receipt`.

A file holds one receipt, several YAML documents, or a list (JSON or YAML); docs/receipts.md
describes the format. `receipt_from_log` files a captured llama.cpp log under its key, for the
engine runtime and the benchmarks. The parsing itself is pure (`core.receipts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from continuum_operator.core.receipts import Receipt, parse_llama_log
from continuum_operator.manifests import ManifestError, yaml_documents

__all__ = ["ReceiptFileError", "load_receipts", "receipt_from_log"]


class ReceiptFileError(ValueError):
    """A receipt file that cannot be read, with the file and field named."""


def load_receipts(paths: Iterable[str | Path]) -> list[Receipt]:
    receipts: list[Receipt] = []
    for path in paths:
        p = Path(path)
        try:
            # JSON is YAML: one bounded reader for both (UTF-8, no aliases, nesting bounded).
            docs: list[Any] = yaml_documents(p)
        except ManifestError as err:
            raise ReceiptFileError(str(err)) from err
        items = [d for doc in docs for d in (doc if isinstance(doc, list) else [doc]) if d]
        for i, item in enumerate(items):
            try:
                receipts.append(Receipt.model_validate(item))
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(x) for x in first["loc"]) or "(document)"
                raise ReceiptFileError(f"{p}: receipt {i}: {where}: {first['msg']}") from err
    return receipts


def receipt_from_log(
    log_text: str,
    *,
    model_sha256: str,
    context_tokens: int,
    llama_build: str | None = None,
    gpus: int = 0,
    source: str = "",
) -> Receipt:
    """File the buffers of one load's log under (model, context, KV type, placement, build)."""
    return parse_llama_log(log_text).receipt(
        model_sha256=model_sha256,
        context_tokens=context_tokens,
        llama_build=llama_build,
        gpus=gpus,
        source=source,
    )
