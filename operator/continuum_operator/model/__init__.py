"""Pydantic resources of group `continuum.dev`, version `v1alpha1`.

These models are the single source of the schemas: the CRD YAML under `crds/` is generated from
them by `crdgen`, and the same models validate files given to `continuum plan`. Pure: no
Kubernetes client is imported here.
"""

from continuum_operator.model.base import API_VERSION, GROUP, VERSION
from continuum_operator.model.board import MemoryMode, NodeBoard, PoolKind, PoolReading
from continuum_operator.model.embedlane import EmbedLane
from continuum_operator.model.engine import Engine, KvCacheType, ModelFacts
from continuum_operator.model.mind import Mind
from continuum_operator.model.mindclass import MindClass
from continuum_operator.model.tokenquota import TokenQuota

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "EmbedLane",
    "Engine",
    "KvCacheType",
    "MemoryMode",
    "Mind",
    "MindClass",
    "ModelFacts",
    "NodeBoard",
    "PoolKind",
    "PoolReading",
    "TokenQuota",
]
