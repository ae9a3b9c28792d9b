"""The embed lane's process follows its EmbedLane (`embed.runtime.LaneObject.watch`): a lease
the operator grows reaches the runtime by the watch, without a read every two seconds; a lane
deleted, or one whose lease cannot be read, keeps the last lease; `status.runtime` is a merge
patch of that field alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from continuum_operator.embed.runtime import LaneObject, LaneState
from continuum_operator.kube.workloads import lane_objects
from continuum_operator.model.embedlane import EmbedLane
from tests.support.builders import ROOT
from tests.support.fake_apiserver import NS, served
from tests.support.lane_watch import LANES, lane
from tests.support.waiting import until


def test_a_grown_lease_reaches_the_lane_by_its_watch_not_by_reads(tmp_path: Path) -> None:
    states: list[LaneState] = []

    async def main() -> None:
        async with served(tmp_path) as (fake, api):
            fake.put(LANES, lane(512))
            lane_obj = LaneObject(NS, "docs", api=api)
            task = asyncio.create_task(lane_obj.watch(states.append))
            try:
                await until(lambda: len(states) == 1)
                fake.put(LANES, lane(2048))  # the operator grew the lease
                await until(lambda: len(states) == 2)
                await lane_obj.write({"largestContextTokens": 2048})
                written = fake.objects[LANES, "docs"]["status"]
                assert written["runtime"] == {"largestContextTokens": 2048}
                assert written["placement"]["contextTokens"] == 2048  # the operator's, kept
                fake.put(LANES, lane(4096, max_context_tokens="many"))  # unreadable: kept
                fake.remove(LANES, "docs")  # deleted: kept
                await asyncio.sleep(0.1)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert len(fake.asked("GET", LANES)) == 1  # the one list; then the watch alone
            assert len(fake.asked("WATCH", LANES)) == 1

    asyncio.run(main())
    # The lane's own write came back by the watch too (a MODIFIED, the same lease).
    assert [s.leased_context_tokens for s in states] == [512, 2048, 2048]


def test_the_lanes_role_lets_its_pod_list_and_watch_its_own_lane_by_name() -> None:
    """What the watch asks (a list and a watch of the lane's collection, its field selector on
    the lane's name) its pod's Role grants, for that one lane; a Role of `get` alone refused
    the lane its lease in a cluster."""
    doc = yaml.safe_load((ROOT / "examples" / "embedlanes" / "notes.yaml").read_text())
    lane = EmbedLane.model_validate(doc)
    role = next(o for o in lane_objects.lane_identity(lane, "uid-1") if o["kind"] == "Role")
    rule = next(r for r in role["rules"] if r["resources"] == [LANES])
    assert {"get", "list", "watch"} <= set(rule["verbs"])
    assert rule["resourceNames"] == [lane.metadata.name]
