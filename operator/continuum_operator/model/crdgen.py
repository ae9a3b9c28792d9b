"""CRD YAML generated from the pydantic resources: the models are the single source of schemas.

Pydantic writes JSON Schema; the API server wants a structural OpenAPI v3 schema. The
translation inlines `$ref`s, turns optional (`anyOf [X, null]`) into X, drops titles and
`additionalProperties: false` (structural schemas prune unknown fields instead), and keeps the
`x-kubernetes-*` extensions the models declare (CEL rules, int-or-string, open parts).

    python -m continuum_operator.model.crdgen crds            # write crds/*.yaml
    python -m continuum_operator.model.crdgen --check crds    # exit 1 when they drift
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from continuum_operator import yaml_text
from continuum_operator.model.base import GROUP, VERSION, ObjectMeta, Resource
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.embedlane import EmbedLane
from continuum_operator.model.engine import Engine
from continuum_operator.model.grant_ledger import GrantLedger
from continuum_operator.model.mind import Mind
from continuum_operator.model.mindclass import MindClass
from continuum_operator.model.tokenquota import TokenQuota

RESOURCES: tuple[type[Resource], ...] = (
    Engine,
    GrantLedger,
    Mind,
    EmbedLane,
    NodeBoard,
    MindClass,
    TokenQuota,
)

_DROPPED_KEYS = {"title", "$defs"}

# What every Kubernetes object's type fields mean, in the words of the API conventions (the same
# text controller-gen writes), so that `kubectl explain` describes them on every resource.
_CONVENTIONS = "https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md"
API_VERSION_DESCRIPTION = (
    "APIVersion defines the versioned schema of this representation of an object. Servers "
    "should convert recognized schemas to the latest internal value, and may reject "
    f"unrecognized values. More info: {_CONVENTIONS}#resources"
)
KIND_DESCRIPTION = (
    "Kind is a string value representing the REST resource this object represents. Servers "
    "may infer this from the endpoint the client submits requests to. Cannot be updated. In "
    f"CamelCase. More info: {_CONVENTIONS}#types-kinds"
)

#: The last `kubectl get` column of every resource: how long ago it was made.
AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    any_of = node.get("anyOf")
    if any_of is not None:
        non_null = [branch for branch in any_of if branch != {"type": "null"}]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", "absent") is None:
            del rest["default"]
        if rest.get("x-kubernetes-preserve-unknown-fields") and not rest.get(
            "x-kubernetes-int-or-string"
        ):
            # An open field (integer or list) keeps only its CEL rules.
            return _inline(rest, defs)
        if rest.get("x-kubernetes-int-or-string"):
            return _inline(rest, defs)
        if len(non_null) == 1:
            return _inline({**non_null[0], **rest}, defs)
        return _inline({**rest, "anyOf": non_null}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "additionalProperties" and value is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
            continue
        if key == "properties":
            # An empty one is dropped: the API server drops it on storage, so a CRD applied with
            # it never equals the stored one, and a second server-side applier (Helm adopting
            # kubectl's CRDs) conflicts on the whole of .spec.versions.
            if value:
                out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
            continue
        out[key] = _inline(value, defs)
    if out.get("default", "absent") is None:
        del out["default"]
    if "exclusiveMinimum" in out:
        # OpenAPI v3.0 takes a boolean here; integers carry the bound as a minimum instead.
        out["minimum"] = out.pop("exclusiveMinimum") + 1
    if "description" in out:
        out["description"] = _description(out["description"])
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "const" in out:
        out["enum"] = [out.pop("const")]
    return out


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    return schema


def _metadata_schema(resource: type[Resource]) -> dict[str, Any]:
    """`metadata` is opaque to a CRD's schema except for its name's length and pattern, which a
    resource narrows where the operator names other objects after it (`LabelNamedMeta`)."""
    meta = resource.model_fields["metadata"].annotation
    # No description: the API server refuses anything in `metadata` but name and generateName
    # ("metadata is implicitly specified"); `kubectl explain` shows ObjectMeta's own.
    schema: dict[str, Any] = {"type": "object"}
    if meta is ObjectMeta or not isinstance(meta, type) or not issubclass(meta, ObjectMeta):
        return schema
    name = meta.model_json_schema()["properties"]["name"]
    kept = {k: name[k] for k in ("description", "maxLength", "pattern") if k in name}
    return {**schema, "properties": {"name": {"type": "string", **kept}}}


def _description(text: str) -> str:
    """A docstring's or a Field's first paragraph on one line: what `kubectl explain` shows."""
    return " ".join(text.split("\n\n")[0].split())


def crd(resource: type[Resource]) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": {"type": "string", "description": API_VERSION_DESCRIPTION},
        "kind": {"type": "string", "description": KIND_DESCRIPTION},
        "metadata": _metadata_schema(resource),
    }
    fields = resource.model_fields
    required = []
    for part in ("spec", "status"):
        if part in fields:
            # Described by the resource's field where it says more, else by the part's model.
            properties[part] = openapi_schema(fields[part].annotation)  # type: ignore[arg-type]
            described = fields[part].description
            if described:
                properties[part]["description"] = _description(described)
            if fields[part].is_required():
                required.append(part)
    root: dict[str, Any] = {"type": "object", "properties": properties}
    if resource.__doc__:
        root["description"] = _description(resource.__doc__)
    if required:
        root["required"] = required
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": root},
    }
    if "status" in fields:
        version["subresources"] = {"status": {}}
    if resource.PRINTER_COLUMNS:
        columns = (*resource.PRINTER_COLUMNS, AGE_COLUMN)
        version["additionalPrinterColumns"] = [dict(c) for c in columns]
    names: dict[str, Any] = {
        "kind": resource.KIND,
        "listKind": f"{resource.KIND}List",
        "plural": resource.PLURAL,
        "singular": resource.KIND.lower(),
    }
    if resource.SHORT_NAMES:
        names["shortNames"] = list(resource.SHORT_NAMES)
    if resource.CATEGORIES:
        names["categories"] = list(resource.CATEGORIES)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{resource.PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": names,
            "scope": "Namespaced" if resource.NAMESPACED else "Cluster",
            "versions": [version],
        },
    }


_HEADER = "# Generated by `make crds` from continuum_operator.model; do not edit by hand.\n"


def rendered() -> dict[str, str]:
    """File name to YAML text, for every resource."""
    return {
        f"{GROUP}_{r.PLURAL}.yaml": _HEADER + yaml_text.dump(crd(r), sort_keys=False, width=100)
        for r in RESOURCES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 when the files drift")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    drifted = []
    for name, text in rendered().items():
        path = directory / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                drifted.append(str(path))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if drifted:
        print(
            "CRDs drifted from the models (run `make crds` and commit): " + ", ".join(drifted),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
