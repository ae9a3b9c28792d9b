"""Receipt files: YAML or JSON documents of `core.receipts.Receipt`, read for `--receipt`.

A file holds one receipt, several YAML documents, or a list (JSON or YAML); docs/receipts.md
describes the format. A captured llama.cpp log is filed under its key by `core.receipts`
(`parse_llama_log(text).receipt(...)`), which is pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from continuum_operator.core.receipts import Receipt
from continuum_operator.manifests import ManifestError, yaml_documents

__all__ = ["ReceiptFileError", "load_receipts"]


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
