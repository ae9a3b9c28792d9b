"""Parked contexts: a reclaimed mind's slot saved before its erase and restored into her slot
at her next grant (docs/gateway.md, "A turn cut off"), in front of the stand-in llama-server
(tests/support/fake_llama.py). The real llama-server runs the same in
tests/e2e/test_gateway_park_llama.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from continuum_operator.engine.admission import GrantTable, TableEntry
from continuum_operator.engine.gateway import SlotRelease
from continuum_operator.engine.metrics import EngineMetrics
from continuum_operator.engine.park import (
    Dropped,
    NotParked,
    Parked,
    evictions,
    gone_minds,
    park_verdict,
)
from continuum_operator.engine.parking import ParkSettings, ParkStore
from continuum_operator.engine.runtime import RuntimePhase, runtime_status
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.model.mind import GrantState
from continuum_operator.model.runtime import EngineRuntimeStatus
from tests.support.fake_llama import FakeLlama
from tests.support.gateway import MIRA, VIP, Rig, granted, queued, reclaiming, table
from tests.support.gateway import run as run_gateway
from tests.support.waiting import until

ANN = "minds/ann"
SHAPE = "sha256:abc/512"


def store(path: Path, budget: int = 1_000_000, shape: str = SHAPE, **kw: float) -> ParkSettings:
    return ParkSettings(path, budget, shape, bytes_per_token=kw.pop("bytes_per_token", 100), **kw)


def run(
    settings: ParkSettings | None,
    initial: GrantTable,
    body: Callable[[Rig], Awaitable[None]],
    fake: FakeLlama,
) -> FakeLlama:
    """test_gateway's rig, its gateway given a park store before the test's body."""

    async def parked(rig: Rig) -> None:
        if settings is not None:
            rig.gateway.park = ParkStore(settings, rig.gateway._post_json, rig.gateway.metrics)
            rig.gateway.park.load()
        await body(rig)

    return run_gateway(initial, parked, fake)


async def ask(rig: Rig, mind: str, prompt: str) -> dict[str, object]:
    async with rig.http.post(
        f"{rig.url}/completion",
        json={"prompt": prompt, "n_predict": 3},
        headers={MIND_HEADER: mind},
    ) as resp:
        reply = await resp.json()
        assert resp.status == 200, reply
        return dict(reply)


async def metrics(rig: Rig) -> str:
    async with rig.http.get(f"{rig.admin_url}/metrics") as resp:
        return await resp.text()


def released(rig: Rig, mind: str = MIRA) -> bool:
    return any(r.mind == mind for r in rig.gateway.releases())


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("park-*"))


class TestParkAndResume:
    def test_a_reclaimed_mind_is_parked_and_resumes_on_her_next_grant(self, tmp_path: Path) -> None:
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c d e f g")  # 8 prompt + 3 generated tokens in slot 0
            rig.gateway.set_table(table(reclaiming(), granted(VIP, slot=1)))
            await until(lambda: released(rig))
            # The save runs behind the release; its record is filled in when it ends.
            await until(lambda: rig.gateway.releases()[0].parked_tokens is not None)
            (record,) = rig.gateway.releases()
            status = record.to_status()
            assert (status["parkedTokens"], status["notParked"], status["erasedTokens"]) == (
                11,
                None,
                11,
            )
            (saved,) = files(tmp_path)
            assert 0 not in rig.fake.n_past  # erased after the save: the next holder sees none
            text = await metrics(rig)
            assert "continuum_gateway_parks_total 1.0" in text
            assert f'continuum_gateway_parked_bytes{{mind="{MIRA}"}} 1100.0' in text
            # Granted again, on the other slot: her first request restores her context first.
            rig.gateway.set_table(table(granted(VIP, slot=0), granted(MIRA, slot=1)))
            reply = await ask(rig, MIRA, "a b c d e f g more")
            assert reply["continuum"]["resumed"] == {"restoredTokens": 11}  # type: ignore[index]
            assert rig.fake.restored == [(1, saved)]
            assert files(tmp_path) == []  # restored: the store holds it no longer
            again = await ask(rig, MIRA, "and more")
            assert "resumed" not in again["continuum"]  # type: ignore[operator]
            text = await metrics(rig)
            assert "continuum_gateway_resumes_total 1.0" in text
            assert "continuum_gateway_restored_tokens_total 11.0" in text
            assert "continuum_gateway_parked_contexts 0.0" in text

        fake = run(store(tmp_path), table(granted()), body, FakeLlama(save_path=str(tmp_path)))
        assert fake.saved and fake.erased == [0]

    def test_another_mind_given_her_old_slot_restores_nothing_of_hers(self, tmp_path: Path) -> None:
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "secret words of mira")
            rig.gateway.set_table(table(reclaiming(), granted(VIP, slot=1)))
            await until(lambda: released(rig))
            rig.gateway.set_table(table(queued(MIRA), granted(ANN, slot=0), granted(VIP, slot=1)))
            reply = await ask(rig, ANN, "hello")
            assert "resumed" not in reply["continuum"]  # type: ignore[operator]
            assert rig.fake.restored == []
            assert len(files(tmp_path)) == 1  # still hers, waiting for her grant
            # A mind's own slot action, naming her file, is refused: only the gateway restores.
            (name,) = files(tmp_path)
            async with rig.http.post(
                f"{rig.url}/slots/0?action=restore",
                json={"filename": name},
                headers={MIND_HEADER: ANN},
            ) as resp:
                assert resp.status == 403
            assert rig.fake.restored == []

        run(store(tmp_path), table(granted()), body, FakeLlama(save_path=str(tmp_path)))

    def test_a_park_that_cannot_finish_before_the_deadline_erases_on_time(
        self, tmp_path: Path
    ) -> None:
        # 11 tokens of 100 bytes at 500 bytes/s: over 2 s to save, and the reclaim has 1 s.
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c d e f g")
            started = time.time()
            rig.gateway.set_table(table(reclaiming(deadline=started + 1.0)))
            await until(lambda: released(rig))
            assert time.time() - started < 1.0
            (record,) = rig.gateway.releases()
            assert (record.not_parked, record.parked_tokens) == (NotParked.NO_TIME, 0)
            assert 'continuum_gateway_park_skips_total{reason="NoTime"} 1.0' in await metrics(rig)

        settings = store(tmp_path, write_bytes_per_second=500)
        fake = run(settings, table(granted()), body, FakeLlama(save_path=str(tmp_path)))
        assert fake.saved == [] and fake.erased == [0] and files(tmp_path) == []

    def test_a_full_store_evicts_the_oldest_park(self, tmp_path: Path) -> None:
        # Each park is 11 tokens of 100 bytes: a store of 2500 bytes holds two.
        async def body(rig: Rig) -> None:
            for mind in (MIRA, ANN, VIP):
                rig.gateway.set_table(table(granted(mind)))
                await ask(rig, mind, "a b c d e f g")
                rig.gateway.set_table(table(reclaiming(mind)))
                await until(lambda m=mind: released(rig, m))  # type: ignore[misc]
                await asyncio.sleep(0.01)
            assert rig.gateway.park is not None
            assert list(rig.gateway.park.parked) == [ANN, VIP]
            assert len(files(tmp_path)) == 2
            text = await metrics(rig)
            assert 'continuum_gateway_park_drops_total{reason="Evicted"} 1.0' in text

        everyone = table(queued(MIRA), queued(ANN), queued(VIP))
        settings = store(tmp_path, budget=2500)

        async def with_everyone(rig: Rig) -> None:
            original = rig.gateway.set_table

            def keep_everyone(t: GrantTable | None) -> None:
                # Every mind stays in the table (queued), so no park is dropped as hers gone.
                assert t is not None
                original(GrantTable(t.slot_tokens, t.phase, {**everyone.entries, **t.entries}))

            rig.gateway.set_table = keep_everyone  # type: ignore[method-assign,assignment]
            await body(rig)

        run(settings, everyone, with_everyone, FakeLlama(save_path=str(tmp_path)))

    def test_her_park_is_deleted_when_her_mind_leaves_the_table(self, tmp_path: Path) -> None:
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c")
            rig.gateway.set_table(table(reclaiming(), granted(VIP, slot=1)))
            await until(lambda: released(rig))
            rig.gateway.set_table(table(queued(MIRA), granted(VIP, slot=1)))
            assert len(files(tmp_path)) == 1
            rig.gateway.set_table(table(granted(VIP, slot=1)))  # her Mind deleted
            assert files(tmp_path) == []
            assert json.loads((tmp_path / "index.json").read_text()) == []

        run(store(tmp_path), table(granted()), body, FakeLlama(save_path=str(tmp_path)))

    def test_a_restart_keeps_parks_of_its_shape_and_drops_the_others(self, tmp_path: Path) -> None:
        metrics_ = EngineMetrics()

        async def nothing(path: str, body: object) -> tuple[int, object]:
            raise AssertionError("no llama-server call")

        mine = "park-" + "a" * 24 + "-" + "b" * 12
        first = ParkStore(store(tmp_path), nothing, metrics_)
        first.load()
        (tmp_path / mine).write_bytes(b"x")
        (tmp_path / "park-stray").write_bytes(b"x")
        first.parked[MIRA] = Parked(MIRA, mine, 1, 1, SHAPE, 1.0)
        first._save_index()
        same = ParkStore(store(tmp_path), nothing, metrics_)
        same.load()
        assert list(same.parked) == [MIRA] and files(tmp_path) == [mine]
        other = ParkStore(store(tmp_path, shape="sha256:def/512"), nothing, metrics_)
        other.load()
        assert other.parked == {} and files(tmp_path) == []

    def test_an_index_naming_a_file_outside_the_store_is_not_read(self, tmp_path: Path) -> None:
        # The index is the gateway's own; one edited to name another file deletes nothing.
        outside = tmp_path / "outside"
        outside.write_bytes(b"keep")
        parks = tmp_path / "parks"
        parks.mkdir()
        hostile = {"mind": MIRA, "file": "../outside", "tokens": 1, "bytes": 1}
        (parks / "index.json").write_text(json.dumps([{**hostile, "shape": "x", "at": 1.0}]))

        async def nothing(path: str, body: object) -> tuple[int, object]:
            raise AssertionError("no llama-server call")

        loaded = ParkStore(store(parks), nothing, EngineMetrics())
        loaded.load()
        assert loaded.parked == {} and outside.read_bytes() == b"keep"

    def test_a_save_given_up_at_the_deadline_leaves_no_file_behind(self, tmp_path: Path) -> None:
        # llama-server wrote the file, but its answer came too late: the save was given up.
        # The file is deleted then, and again if llama-server writes it after.
        written: list[str] = []

        async def slow_save(path: str, body: object) -> tuple[int, object]:
            assert isinstance(body, dict)
            (tmp_path / body["filename"]).write_bytes(b"x" * 1100)
            written.append(body["filename"])
            await asyncio.sleep(10)
            raise AssertionError("given up before")

        parks = ParkStore(store(tmp_path), slow_save, EngineMetrics())
        parks.load()

        async def give_up() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(parks.park(MIRA, 0, 11, time.time() + 10), 0.1)

        asyncio.run(give_up())
        assert written and parks.parked == {} and files(tmp_path) == []
        (tmp_path / written[0]).write_bytes(b"x" * 1100)  # llama-server got to it later
        parks.forget(table(granted()))
        assert files(tmp_path) == []

    def test_a_small_saves_time_does_not_teach_the_write_rate(self, tmp_path: Path) -> None:
        saves = [(100, 100 * 100, 50.0), (10_000, 10_000 * 1000, 20.0)]

        async def save(path: str, body: object) -> tuple[int, object]:
            tokens, n_bytes, ms = saves.pop(0)
            timings = {"save_ms": ms}
            return 200, {"n_saved": tokens, "n_written": n_bytes, "timings": timings}

        parks = ParkStore(store(tmp_path, budget=2**40), save, EngineMetrics())
        asyncio.run(parks.park(MIRA, 0, 100, time.time() + 10))
        assert parks.write_rate == 100e6  # 10 kB in 50 ms is its fixed cost, not a rate
        asyncio.run(parks.park(ANN, 1, 10_000, time.time() + 10))
        assert parks.write_rate == (100e6 + 10_000 * 1000 / 0.02) / 2


class _RestoreWatch(FakeLlama):
    """The stand-in, noting at each completion how many restores it had answered."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.restores_seen: list[int] = []

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self.restores_seen.append(len(self.restored))
        return await super().completion(request)


class TestParkBehindTheRelease:
    def test_the_slot_is_released_before_the_save_and_its_next_holder_waits_for_it(
        self, tmp_path: Path
    ) -> None:
        # Saving takes llama-server 0.5 s here: the release is reported without waiting for
        # it; the next holder's first request waits for the save and the erase instead.
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c d e f g")
            started = time.monotonic()
            rig.gateway.set_table(table(reclaiming(), granted(VIP, slot=1)))
            await until(lambda: released(rig))
            assert time.monotonic() - started < 0.25
            (record,) = rig.gateway.releases()
            assert (record.parked_tokens, record.not_parked, record.erased_tokens) == (
                None,
                None,
                None,
            )
            assert rig.fake.erased == []  # the save runs; the erase follows it
            rig.gateway.set_table(table(reclaiming(), granted(ANN, slot=0), granted(VIP, slot=1)))
            reply = await ask(rig, ANN, "hello")
            assert time.monotonic() - started >= 0.5  # she waited for the save
            assert "resumed" not in reply["continuum"]  # type: ignore[operator]
            assert rig.fake.erased[0] == 0 and len(rig.fake.saved) == 1
            (record,) = rig.gateway.releases()  # filled in once the save ended
            assert (record.parked_tokens, record.not_parked, record.erased_tokens) == (
                11,
                None,
                11,
            )

        fake = FakeLlama(save_path=str(tmp_path), save_seconds=0.5)
        run(store(tmp_path), table(granted(), granted(VIP, slot=1)), body, fake)

    def test_her_first_requests_at_once_all_run_after_her_restore(self, tmp_path: Path) -> None:
        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c d e f g")
            rig.gateway.set_table(table(reclaiming(), granted(VIP, slot=1)))
            await until(lambda: released(rig))
            await until(lambda: bool(rig.fake.erased))  # saved, then erased
            rig.gateway.set_table(table(granted(VIP, slot=0), granted(MIRA, slot=1)))
            fake = rig.fake
            assert isinstance(fake, _RestoreWatch)
            fake.restores_seen.clear()
            replies = await asyncio.gather(*(ask(rig, MIRA, "a b c d e f g h") for _ in "ab"))
            resumed = [r["continuum"].get("resumed") for r in replies]  # type: ignore[attr-defined]
            assert sorted(map(bool, resumed)) == [False, True]  # one restore, for the first
            assert fake.restores_seen == [1, 1]  # neither ran before it

        fake = _RestoreWatch(save_path=str(tmp_path), save_seconds=0.3)
        run(store(tmp_path), table(granted(), granted(VIP, slot=1)), body, fake)


class TestParkWhenIdle:
    def test_a_mind_going_idle_parks_herself_and_her_next_request_resumes(
        self, tmp_path: Path
    ) -> None:
        async def park(rig: Rig, mind: str) -> tuple[int, dict[str, object]]:
            async with rig.http.post(f"{rig.url}/v1/park", headers={MIND_HEADER: mind}) as resp:
                return resp.status, await resp.json()

        async def body(rig: Rig) -> None:
            await ask(rig, MIRA, "a b c d e f g")
            assert await park(rig, MIRA) == (200, {"parked": True, "tokens": 11, "slot": 0})
            assert rig.fake.erased == [0] and len(files(tmp_path)) == 1
            reply = await ask(rig, MIRA, "a b c d e f g h")
            assert reply["continuum"]["resumed"] == {"restoredTokens": 11}  # type: ignore[index]
            status, refused = await park(rig, ANN)  # queued: she has no slot to park
            assert (status, refused["error"]) == (429, "queued")

        run(
            store(tmp_path), table(granted(), queued(ANN)), body, FakeLlama(save_path=str(tmp_path))
        )

    def test_a_mind_parked_idle_is_reported_idle_until_she_asks_again(self, tmp_path: Path) -> None:
        # Idle, her slot may go to a mind waiting (the operator reclaims it, `Parked`); any
        # request of hers, even one refused as queued, says she is back.
        async def body(rig: Rig) -> None:
            parks = rig.gateway.park
            assert parks is not None
            await ask(rig, MIRA, "a b c d e f g")
            async with rig.http.post(f"{rig.url}/v1/park", headers={MIND_HEADER: MIRA}) as resp:
                assert resp.status == 200
            assert parks.to_status()["idle"] == [MIRA]
            given = table(reclaiming(), granted(ANN, slot=1))
            rig.gateway.set_table(given)
            await until(lambda: released(rig))
            assert parks.to_status()["idle"] == [MIRA]  # her context stays parked, she idle
            rig.gateway.set_table(table(queued(MIRA), granted(ANN, slot=0)))
            async with rig.http.post(
                f"{rig.url}/completion", json={"prompt": "hi"}, headers={MIND_HEADER: MIRA}
            ) as resp:
                assert resp.status == 429
            assert parks.to_status()["idle"] == [] and parks.waiting(MIRA)

        run(store(tmp_path), table(granted()), body, FakeLlama(save_path=str(tmp_path)))

    def test_an_engine_without_a_store_says_it_parks_nothing(self, tmp_path: Path) -> None:
        async def body(rig: Rig) -> None:
            async with rig.http.post(f"{rig.url}/v1/park", headers={MIND_HEADER: MIRA}) as resp:
                reply = await resp.json()
                assert (resp.status, reply["error"]) == (400, "bad_request")
                assert "spec.park" in reply["message"]

        fake = run(None, table(granted()), body, FakeLlama(save_path=str(tmp_path)))
        assert fake.saved == [] and fake.erased == []


class TestDecisions:
    def test_a_park_is_refused_where_it_would_outlast_the_deadline_or_the_store(self) -> None:
        def verdict(**kw: float) -> NotParked | None:
            args = {"budget": 10_000, "tokens": 10, "bytes_per_token": 100.0}
            args |= {"write_bytes_per_second": 1000.0, "seconds_left": 10.0}
            return park_verdict(**(args | kw)).reason  # type: ignore[arg-type]

        assert verdict() is None  # 1000 bytes, 1 s (2 s with its margin, +0.5 s) in 10 s
        assert verdict(seconds_left=2.4) is NotParked.NO_TIME
        assert verdict(budget=999) is NotParked.TOO_LARGE
        assert verdict(budget=0) is NotParked.NO_STORE
        assert verdict(tokens=0) is NotParked.EMPTY
        assert verdict(bytes_per_token=0.0) is NotParked.SIZE_UNKNOWN

    def test_eviction_takes_the_least_recently_parked_first_until_it_fits(self) -> None:
        parked = {
            m: Parked(m, f"park-{i}", 1, 400, SHAPE, at)
            for i, (m, at) in enumerate([(ANN, 2.0), (MIRA, 1.0), (VIP, 3.0)])
        }
        assert evictions(parked, 1200, 0) == []
        assert [p.mind for p in evictions(parked, 1200, 400)] == [MIRA]
        assert [p.mind for p in evictions(parked, 1200, 800)] == [MIRA, ANN]

    def test_a_park_goes_with_her_mind_or_her_refusal_not_with_an_unlisted_queue(self) -> None:
        parked = {m: Parked(m, "park-x", 1, 1, SHAPE, 1.0) for m in (MIRA, ANN, VIP)}
        refused = TableEntry(ANN, GrantState.QUEUED, "ContextTooLarge")
        deleted = TableEntry(VIP, GrantState.RECLAIMING, "MindDeleted", slot=0, since="r")
        t = GrantTable(512, entries={ANN: refused, VIP: deleted})
        assert gone_minds(t, parked) == {
            MIRA: Dropped.MIND_GONE,
            ANN: Dropped.REFUSED,
            VIP: Dropped.MIND_GONE,
        }
        long_queue = GrantTable(512, entries={}, left_out=True)
        assert gone_minds(long_queue, parked) == {}


def test_the_park_store_status_is_what_the_engine_status_schema_keeps(tmp_path: Path) -> None:
    # A structural schema prunes a field it does not name: each key written is a field.
    async def nothing(path: str, body: object) -> tuple[int, object]:
        raise AssertionError("no llama-server call")

    parks = ParkStore(store(tmp_path, budget=5000), nothing, EngineMetrics())
    parks.parked[MIRA] = Parked(MIRA, "park-mira", 11, 1100, SHAPE, 1.0)
    doc = runtime_status(
        phase=RuntimePhase.SERVING,
        ready=True,
        restarts=0,
        receipt=None,
        log_text="",
        plan={},
        slots=2,
        slot_tokens=512,
        releases=[SlotRelease(MIRA, 0, "Preempted", "r", 5.0, 11, 11, None).to_status()],
        park=parks.to_status(),
    )
    status = EngineRuntimeStatus.model_validate(doc)
    assert status.park is not None and status.park.parked_bytes == 1100
    assert [m.mind for m in status.park.minds] == [MIRA]
    assert status.slot_releases is not None and status.slot_releases[0].parked_tokens == 11
