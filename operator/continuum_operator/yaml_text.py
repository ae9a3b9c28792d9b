"""YAML text that Kubernetes reads back as it was written.

kubectl and Helm parse YAML with Go's go-yaml, which takes more plain scalars for numbers and
booleans than PyYAML does: `85979e45` and `1.0e5` are floats to it (PyYAML wants a dot and a
signed exponent), `y` and `n` booleans. PyYAML quotes a string only where its own reader would
take it for something else, so `yaml.safe_dump({"run": "85979e45"})` writes `run: 85979e45`, and
kubectl refuses the label ("cannot unmarshal number into ... labels of type string"). Found when
a test's random hex label happened to be all digits and one `e`. Every YAML this project writes
for kubectl, Helm or a person to apply goes through here, so those strings are quoted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import yaml

__all__ = ["KubeDumper", "dump", "dump_all"]


class KubeDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting also the strings go-yaml would read as floats or bools."""


# go-yaml's float (resolve.go, yamlStyleFloat) and its YAML 1.1 booleans PyYAML lacks.
KubeDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)
KubeDumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(y|Y|n|N)$"), list("yYnN"))


def dump(doc: Any, **options: Any) -> str:
    """One document as YAML kubectl reads back unchanged (`yaml.safe_dump`'s options)."""
    return str(yaml.dump(doc, Dumper=KubeDumper, **options))


def dump_all(docs: Iterable[Any], **options: Any) -> str:
    """Several documents, `---` between them, as `dump` writes each."""
    return str(yaml.dump_all(docs, Dumper=KubeDumper, **options))
