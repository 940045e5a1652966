"""The event stream's order against real PostgreSQL (embedded and 15): an event whose transaction
commits late, with a lower id than one already committed, is neither skipped nor sent twice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import asyncpg
import pytest

from podium.api import events
from podium.api.events import EventHub, Filters, cursor_of_row
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.ui import UiStore
from tests.integration.helpers import add_node, submit


async def wait_async(read, timeout: float = 30.0, until=bool):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await read()
        if until(got) or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.05)


INSERT = "INSERT INTO task_events (task_id, to_state, actor) VALUES ($1, 'queued', 'test') RETURNING id"


async def test_a_late_commit_with_a_lower_id_is_delivered_after_the_earlier_one_none_twice(store: Store) -> None:
    ui = UiStore(store)
    tid = await submit(store)
    async with store.pool.acquire() as c:
        start = await ui.cursor_of(await c.fetchval("SELECT max(id) FROM task_events"))  # after the submit's event
    a = await asyncpg.connect(store.dsn)
    b = await asyncpg.connect(store.dsn)
    try:
        ta = a.transaction()
        await ta.start()
        low = await a.fetchval(INSERT, tid)  # takes its id (and transaction id) first...
        async with b.transaction():
            high = await b.fetchval(INSERT, tid)  # ...but commits second
        assert low < high
        # the committed event waits behind the open transaction, and the stream knows to look again
        assert [r.id for r in await ui.events_after(start, 100)] == []
        assert await ui.hub_read(start, 100) == ([], True)
        await ta.commit()
        # (on a shared server another database's open transaction may hold the horizon a moment, even
        # between the two: wait for both, then check their order)
        got = await wait_async(lambda: ui.events_after(start, 100), until=lambda got: len(got) >= 2)
        assert [r.id for r in got] == [low, high]
        assert await ui.hub_read(start, 100) == (got, False)  # the hub's read: the same rows, none held
        # resuming from either delivers exactly what followed it
        assert [r.id for r in await ui.events_after(cursor_of_row(got[0]), 100)] == [high]
        assert await ui.events_after(cursor_of_row(got[1]), 100) == []
        assert [r.id for r in await ui.events_after(await ui.cursor_of(low), 100)] == [high]
        assert await ui.hub_read(cursor_of_row(got[1]), 100) == ([], False)
    finally:
        await a.close()
        await b.close()


async def test_node_changes_are_events_and_a_heartbeat_is_not(store: Store) -> None:
    ui = UiStore(store)
    start = await ui.start_cursor()
    await add_node(store, "n1")
    await store.set_draining("n1", True)
    await store.heartbeats([("n1", 1)], "test")
    await store.set_draining("n1", False)  # a change after the heartbeat: any event of it comes before
    # Events are delivered below the oldest transaction still open anywhere on the server (another
    # test's, on a shared cluster), so the later ones may arrive a little later: wait for the last.
    rows = await wait_async(lambda: ui.events_after(start, 100, tasks=False), until=lambda got: len(got) >= 3)
    assert [(r.kind, r.node_id, r.draining) for r in rows] == [("node", "n1", False), ("node", "n1", True), ("node", "n1", False)]
    assert await ui.events_after(start, 100, nodes=False) == []


async def test_a_stream_limited_to_several_states_reads_the_same_events_live_and_on_catch_up(store: Store) -> None:
    """`?state=running,succeeded`: the catch-up query (SQL) and the hub's filter (memory) keep the same
    events, a task's events into any of those states and nothing else, not a node's."""
    ui = UiStore(store)
    start = await ui.start_cursor()
    tid = await submit(store)
    await add_node(store, "n-states")
    async with store.pool.acquire() as c:
        for to in ("assigned", "running", "succeeded"):
            await c.execute("INSERT INTO task_events (task_id, to_state, actor) VALUES ($1, $2, 'test')", tid, to)
    everything = await wait_async(lambda: ui.events_after(start, 100), until=lambda got: len(got) >= 5)
    assert [r.state for r in everything if r.task_id == tid] == ["queued", "assigned", "running", "succeeded"]
    limited = Filters(None, None, frozenset({"running", "succeeded"}), {"task", "node"})
    caught_up = await ui.events_after(start, 100, **limited.db())
    assert [(r.task_id, r.state) for r in caught_up] == [(tid, "running"), (tid, "succeeded")]
    assert [r.id for r in everything if limited.match(r)] == [r.id for r in caught_up]
    one = Filters(None, None, frozenset({"queued"}), {"task"})
    assert [r.state for r in await ui.events_after(start, 100, **one.db())] == ["queued"]


async def test_the_hub_wakes_on_notify_and_fans_out_to_filtered_clients(store: Store) -> None:
    ui = UiStore(store)
    hub = EventHub(store, ui)
    t1 = await submit(store)
    try:
        await hub.ensure_started()
        mine = hub.follow(None, Filters(t1, None, None, {"task"}).match, {})
        everything = hub.follow(None, Filters(None, None, None, {"task", "node"}).match, {})
        first_mine = asyncio.ensure_future(mine.__anext__())
        # On a shared server another database's open transaction can hold the horizon back, so
        # the hub may begin before t1's own submission: the unfiltered client then sees that first.
        # What matters is that it sees the other task, which the filtered one never does.
        seen: list[Any] = []
        reader = asyncio.ensure_future(_collect(everything, seen))
        # every step bounded: a step that never ends fails here, at its own line, not at the suite's
        # timeout (one CI run hung in this test for 300 s, somewhere in it)
        async with asyncio.timeout(30):
            while hub.clients < 2:  # both clients have taken their place at the hub's head
                await asyncio.sleep(0.01)
        async with asyncio.timeout(30):
            t2 = await submit(store)
        async with asyncio.timeout(30), store.pool.acquire() as c:
            await c.execute(INSERT, t1)
        deadline = asyncio.get_running_loop().time() + 30
        while not any(r.task_id == t2 for r in seen) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        got_other = next((r for r in seen if r.task_id == t2), None)
        assert got_other is not None, f"the unfiltered client never saw {t2}; it saw {seen}"
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        async with asyncio.timeout(30):
            got_mine = await first_mine
        assert got_other.task_id == t2 != t1
        assert got_mine is not None and got_mine.task_id == t1
        async with asyncio.timeout(30):
            await mine.aclose()
            await everything.aclose()
    finally:
        hub.close()


async def test_a_stream_cancelled_in_the_turn_its_wake_comes_ends(store: Store) -> None:
    """A stream's client goes (its task cancelled) just as the hub wakes the stream: the cancel ends
    it. Waited on with Python 3.11's `asyncio.wait_for`, a wait that ended in the same turn as the
    cancel returned its result instead, the cancel was lost, and the stream went on waiting for a
    client that was gone (a test that cancelled its reader then waited for it forever). Every turn
    from the wake to the stream's resumption is tried."""
    ui = UiStore(store)
    hub = EventHub(store, ui)
    try:
        await hub.ensure_started()
        for turns in range(6):
            stream = hub.follow_batches(None, Filters(None, None, None, {"task"}).match, {})
            reader = asyncio.ensure_future(_collect(stream, []))
            async with asyncio.timeout(30):
                while hub.clients < 1:  # the stream waits at the hub's head
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            changed, hub._changed = hub._changed, asyncio.Event()  # the hub's wake, as its reads make
            changed.set()  # it, with nothing new for the stream
            for _ in range(turns):
                await asyncio.sleep(0)
            reader.cancel()
            done, _ = await asyncio.wait({reader}, timeout=5)
            assert reader in done and reader.cancelled(), f"a cancel {turns} turns after the wake was lost"
            async with asyncio.timeout(30):
                while hub.clients > 0:
                    await asyncio.sleep(0.01)
    finally:
        hub.close()


async def _collect(stream: Any, into: list[Any]) -> None:
    async for r in stream:
        if r is not None:
            into.append(r)


async def test_a_client_is_given_what_one_read_found_in_one_batch(store: Store) -> None:
    """Five submits in one transaction are one read of the hub's, and one batch to each client: its
    stream writes them at once (one write per event cost a busy server more than the events)."""
    ui = UiStore(store)
    hub = EventHub(store, ui)
    try:
        await hub.ensure_started()
        batches = hub.follow_batches(None, Filters(None, None, None, {"task"}).match, {})
        first = asyncio.ensure_future(batches.__anext__())
        while hub.clients < 1:  # the client has taken its place at the hub's head
            await asyncio.sleep(0.01)
        rows = await store.submit_many([(TaskSpec(command=["true"]), None)] * 5, actor="test")
        batch = await asyncio.wait_for(first, 30)
        assert batch is not None
        assert sorted(r.task_id for r in batch) == sorted(r.id for r, _created in rows)
        assert {(r.from_state, r.state) for r in batch} == {(None, "queued")}
        await batches.aclose()
    finally:
        hub.close()


async def test_after_a_busy_read_the_hub_waits_for_more_commits_and_after_a_quiet_one_it_does_not(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that found many events (a busy fleet) is followed by a pause before the next read, so
    that one read takes what several commits wrote; a read that found few is not: one task at a time,
    its next event is read as soon as it is committed."""
    monkeypatch.setattr(events, "COALESCE", 2.0)  # long enough to see, whatever the machine's speed
    ui = UiStore(store)
    hub = EventHub(store, ui)
    tid = await submit(store)
    try:
        await hub.ensure_started()
        stream = hub.follow_batches(None, Filters(tid, None, None, {"task"}).match, {})
        seen: list[Any] = []

        async def collect() -> None:
            async for batch in stream:
                seen.extend(r for r in batch or () if r.actor == "test")  # not the submission's own

        reader = asyncio.ensure_future(collect())
        async with asyncio.timeout(30):
            while hub.clients < 1:
                await asyncio.sleep(0.01)

        async def commit(n: int) -> float:
            """`n` events of the task in one commit; how long until the client had them."""
            want = len(seen) + n
            t0 = time.monotonic()
            async with store.pool.acquire() as c:
                await c.execute("INSERT INTO task_events (task_id, to_state, actor) "
                                "SELECT $1, 'queued', 'test' FROM generate_series(1, $2)", tid, n)  # fmt: skip
            async with asyncio.timeout(30):
                while len(seen) < want:
                    await asyncio.sleep(0.01)
            return time.monotonic() - t0

        await commit(events.BUSY_READ + 4)  # a busy read
        pauses = hub.pauses
        # read only after the pause (more than one if a wake that brought nothing came first: on a
        # shared server another database's open transaction can hold events back, and the hub looks again)
        assert await commit(1) >= 2.0 and hub.pauses > pauses
        pauses = hub.pauses
        await commit(1)  # (that read found one event: a quiet one)
        assert hub.pauses == pauses, "a read after a quiet one waited"
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    finally:
        hub.close()
