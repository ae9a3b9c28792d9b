"""`continuum embed --lane FILE`: the lane file, read again whenever it changes (embed/runtime.py
`watch_lane_file`). Anyone may write it: a malformed one is refused by name and the last lease
kept, and the watch goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from continuum_operator.embed import runtime as lane_runtime


@pytest.mark.parametrize(
    "malformed",
    [
        "spec: {maxContextTokens: 4096}\nstatus: {placement: [1]}\n",
        "spec: {maxContextTokens: 4096}\n"
        "status: {placement: {verdict: Fits, contextTokens: [1]}}\n",
        "spec: [1]\n",
    ],
    ids=["placement-a-list", "tokens-a-list", "spec-a-list"],
)
def test_a_malformed_lane_file_is_refused_and_the_watch_reads_the_next(
    tmp_path: Path, malformed: str
) -> None:
    # Before: its AttributeError or TypeError ended the watch task, and the corrected file was
    # never read (the lease frozen).
    path = tmp_path / "lane.yaml"
    path.write_text(malformed)
    seen: list[lane_runtime.LaneState] = []

    async def main() -> None:
        task = asyncio.create_task(
            lane_runtime.watch_lane_file(path, None, seen.append, poll_seconds=0.01)
        )
        await asyncio.sleep(0.1)
        path.write_text(
            "spec: {maxContextTokens: 4096}\n"
            "status: {placement: {verdict: Fits, contextTokens: 1024, residence: host}}\n"
        )
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()

    asyncio.run(main())
    assert [s.leased_context_tokens for s in seen] == [1024]


def test_a_malformed_lane_document_says_what_to_give() -> None:
    with pytest.raises(ValueError, match="not an EmbedLane nor a placement document"):
        lane_runtime.lane_state_from(
            {"status": {"placement": [1]}, "spec": {"maxContextTokens": 8}}
        )
