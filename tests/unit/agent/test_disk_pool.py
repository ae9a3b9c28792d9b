"""The node's disk as a pool of its board (where park stores on disk are charged): read by the
agent from statvfs of the path it is given, beside the memory pools of any mode, and a board
with a disk pool keeps its memory mode's rules (docs/plan.md, docs/gateway.md "Parked
contexts")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from continuum_operator.agent import disk, probe
from continuum_operator.core.nodeboard import board_status
from continuum_operator.model.board import NodeBoard, PoolKind
from tests.support.boards import board_of, fixture
from tests.support.builders import GiB, board_body

GB10 = "gb10-unified"


def test_the_disk_is_read_from_statvfs_of_the_path_given(tmp_path: Path) -> None:
    raw = disk.read_raw(tmp_path)
    assert raw is not None and raw["path"] == str(tmp_path)
    reading = disk.parse(raw)
    assert reading is not None and 0 <= reading.used_bytes <= reading.capacity_bytes
    assert disk.read_raw(None) is None  # not asked: no disk pool
    assert disk.parse(disk.read_raw(tmp_path / "missing")) is None  # an error: none either


def test_a_probe_given_a_disk_path_makes_a_disk_pool_beside_the_unified_one(
    tmp_path: Path,
) -> None:
    raw = {"path": "/var/lib/kubelet", "f_frsize": 4096, "f_blocks": 1000, "f_bavail": 250}
    status = board_of({**fixture(GB10), "disk": raw})
    kinds = [p.kind for p in status.pools]
    assert kinds == [PoolKind.UNIFIED, PoolKind.DISK]
    (pool,) = [p for p in status.pools if p.kind is PoolKind.DISK]
    assert (pool.capacity_bytes, pool.used_bytes) == (4096 * 1000, 4096 * 750)
    assert [p.kind for p in board_of(fixture(GB10)).pools] == [PoolKind.UNIFIED]
    doc, _ = probe.capture(probe.ProbeSettings(disk_path=tmp_path, scan_environ=False))
    assert doc["disk"]["path"] == str(tmp_path)
    assert any(p.kind is PoolKind.DISK for p in board_status(probe.readings(doc)).pools)


def board_doc(*pools: dict[str, Any]) -> dict[str, Any]:
    return board_body("unified", [{"kind": "unified", "capacityBytes": 32 * GiB}, *pools])


def test_a_board_has_at_most_one_disk_pool_and_it_is_not_a_memory_pool() -> None:
    one = {"kind": "disk", "capacityBytes": 100 * GiB, "usedBytes": 0}
    NodeBoard.model_validate(board_doc(one))  # the unified board's rule holds beside it
    with pytest.raises(ValidationError, match="at most one `disk` pool"):
        NodeBoard.model_validate(board_doc(one, one))
    with pytest.raises(ValidationError, match="exactly one pool of kind `unified`"):
        NodeBoard.model_validate(board_body("unified", [one]))


def test_the_charts_agent_reads_the_kubelets_disk_read_only_unless_told_not_to() -> None:
    """The agent as the chart deploys it has a disk pool: without --disk-path no board had one,
    so an Engine parking on disk was placed nowhere on every node."""
    from continuum_operator.cli import build_parser
    from tests.support.helm import documents, find_helm, one, template

    helm = find_helm()
    ds = one(documents(template(helm).stdout), "DaemonSet", "-agent")
    pod = ds["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = build_parser().parse_args(container["args"])
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "disk"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "disk"]
    assert volume["hostPath"]["path"] == "/var/lib/kubelet" and mount["readOnly"] is True
    assert args.disk_path == Path(mount["mountPath"])
    ds = one(documents(template(helm, {"agent": {"diskPath": ""}}).stdout), "DaemonSet", "-agent")
    assert "disk" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert "--disk-path" not in str(ds["spec"]["template"]["spec"]["containers"][0]["args"])
