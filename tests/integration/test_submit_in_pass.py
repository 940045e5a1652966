"""A submission handed to an idle dispatcher: stored and placed by one pass, in one transaction, and
never lost or stored twice when that pass does not store it or fails."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from podium.errors import StoreUnavailable
from podium.scheduler.service import Scheduler
from podium.spec import TaskSpec
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import WAIT, add_node, place, submit, until

# No pass of the loop's own (the tick): a test's submission must find the dispatcher idle, and a pass
# the tick began at that moment would make it the handler's, on a machine of any speed. Every pass
# here is one a submission, a NOTIFY or the test asked for.
TIMING = dataclasses.replace(DEFAULT_TIMING, tick=3600.0)


@asynccontextmanager
async def running(sched: Scheduler) -> AsyncIterator[Scheduler]:
    """The scheduler's dispatch loop running, and idle (waiting for a wake-up) when this yields."""
    task = asyncio.get_running_loop().create_task(sched.dispatcher.loop.run())
    try:
        await until(lambda: sched.dispatcher.loop.idle, "the dispatch loop waits for a wake-up")
        yield sched
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sched.dispatcher.loop.close()


def spec(**fields: Any) -> TaskSpec:
    return TaskSpec(command=["true"], **fields)


async def txids(store: Store, task_id: uuid.UUID) -> list[tuple[str, int]]:
    """The task's events in order: the state each entered and the transaction that recorded it."""
    async with store.pool.acquire() as c:
        rows = await c.fetch("SELECT to_state, txid::text::bigint AS txid FROM task_events WHERE task_id = $1 ORDER BY id", task_id)
    return [(r["to_state"], r["txid"]) for r in rows]


async def task_count(store: Store) -> int:
    async with store.pool.acquire() as c:
        return int(await c.fetchval("SELECT count(*) FROM tasks"))


async def test_an_idle_dispatcher_stores_and_places_a_submission_in_one_transaction(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    async with running(Scheduler(store, TIMING, server_id="a")) as sched:
        [(row, created)] = await sched.submit_many([(spec(name="first"), None)], actor="op")
        assert created and row.name == "first"
        # answered once the pass committed: the task is on its node already
        task = await store.get_task(row.id)
        assert (task.state, task.node_id) == ("assigned", "n1")
        events = await txids(store, row.id)
        assert [s for s, _ in events] == ["queued", "assigned"]
        assert events[0][1] == events[1][1], "submission and placement in one transaction"
        # a batch too, each task answered in its order
        rows = await sched.submit_many([(spec(name=f"b{i}"), None) for i in range(3)], actor="op")
        assert [r.name for r, _ in rows] == ["b0", "b1", "b2"] and all(c for _, c in rows)
        for r, _ in rows:
            events = await txids(store, r.id)
            assert [s for s, _ in events] == ["queued", "assigned"] and events[0][1] == events[1][1]
    assert await task_count(store) == 4


async def test_the_pass_hands_its_assigns_to_the_gateway_before_it_answers_the_submission(store: Store) -> None:
    # The handler's HTTP answer is not on any task's way to its node: the Assign goes first.
    await add_node(store, "n1", slots=4)
    sched = Scheduler(store, TIMING, server_id="a")
    handed: list[asyncio.Future[Any]] = []
    take = sched.dispatcher.take_submission

    def taking(sub: Any) -> Any:
        fut = take(sub)
        if fut is not None:
            handed.append(fut)
        return fut

    sched.dispatcher.take_submission = taking  # type: ignore[method-assign]
    answered_at_push: list[list[bool]] = []
    sched.deliver_through(lambda: ["n1"], lambda rows: answered_at_push.append([f.done() for f in handed]))
    async with running(sched):
        [(row, created)] = await sched.submit_many([(spec(name="first"), None)], actor="op")
    assert created and (await store.get_task(row.id)).state == "assigned"
    assert answered_at_push == [[False]], "the Assign was pushed after the submission was answered"


async def test_a_submission_the_pass_cannot_place_is_stored_by_it_and_queued(store: Store) -> None:
    async with running(Scheduler(store, TIMING, server_id="a")) as sched:
        [(row, created)] = await sched.submit_many([(spec(), None)], actor="op")
    assert created
    task = await store.get_task(row.id)
    assert task.state == "queued"
    assert [s for s, _ in await txids(store, row.id)] == ["queued"]
    assert await task_count(store) == 1


async def test_a_keyed_submission_or_a_busy_dispatcher_is_stored_by_its_handler(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    # no loop running: the dispatcher is not idle and takes nothing
    sched = Scheduler(store, TIMING, server_id="a")
    assert sched.dispatcher.take_submission(store.submissions([(spec(), None)], actor="op")) is None
    [(alone, _)] = await sched.submit_many([(spec(), None)], actor="op")
    assert (await store.get_task(alone.id)).state == "queued"
    async with running(sched):
        # a key may refuse its batch (Conflict): never inside a pass that places other tasks too
        [(keyed, created)] = await sched.submit_many([(spec(), "key-1")], actor="op")
        assert created
        # stored on its own, and placed by the pass its NOTIFY wakes (with the one left queued above)
        await until_state(store, keyed.id, "assigned")
        await until_state(store, alone.id, "assigned")
        events = await txids(store, keyed.id)
        assert [s for s, _ in events] == ["queued", "assigned"] and events[0][1] != events[1][1]
        [(again, created)] = await sched.submit_many([(spec(), "key-1")], actor="op")
        assert (again.id, created) == (keyed.id, False)
    assert await task_count(store) == 2


async def until_state(store: Store, task_id: uuid.UUID, state: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while (await store.get_task(task_id)).state != state:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"task {task_id} not {state} within {WAIT:.0f}s")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("after_commit", [False, True], ids=["before-its-commit", "after-its-commit"])
async def test_a_failed_pass_loses_nothing_and_stores_nothing_twice(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, after_commit: bool
) -> None:
    await add_node(store, "n1", slots=4)
    real = store.dispatch
    failed: list[bool] = []

    async def fails_once(**kw: Any) -> Any:
        if kw["submissions"] and not failed:
            failed.append(True)
            if after_commit:
                await real(**kw)  # committed: the tasks are stored (and placed), then the answer is lost
            raise StoreUnavailable("lost the connection to PostgreSQL: a test cut it")
        return await real(**kw)

    monkeypatch.setattr(store, "dispatch", fails_once)
    # The ordinary tick: a loop whose pass lost the store listens again only at its next tick, and
    # that pass places what the handler stored meanwhile (the one submission below is taken in the
    # same turn as the loop is seen idle: no tick can come between)
    with caplog.at_level(logging.WARNING, logger="podium.scheduler.service"):
        async with running(Scheduler(store, DEFAULT_TIMING, server_id="a")) as sched:
            rows = await sched.submit_many([(spec(name="x"), None), (spec(name="y"), None)], actor="op")
            assert failed == [True]
            assert [(r.name, c) for r, c in rows] == [("x", True), ("y", True)]
            for r, _ in rows:
                await until_state(store, r.id, "assigned")
    assert await task_count(store) == 2
    assert "a dispatch pass given 2 new tasks failed (lost the connection to PostgreSQL: a test cut it)" in caplog.text
    async with store.pool.acquire() as c:
        audit = await c.fetchval("SELECT count(*) FROM audit_log WHERE action = 'task.submit'")
    assert audit == 2


async def test_a_full_window_or_a_held_dispatcher_leaves_the_submission_to_its_handler(store: Store) -> None:
    """A dispatcher whose window is full, or that holds placements, never idles (it looks again
    within WINDOW_POLL); a submission handed to it just before its pass found that is stored by its
    handler, once."""
    await add_node(store, "n1", slots=4)
    waiting = await submit(store)
    await place(store)  # assigned, not yet accepted: a window of one is full
    full = Scheduler(store, dataclasses.replace(TIMING, assign_window=1), server_id="a")
    held = Scheduler(store, TIMING, server_id="b")
    held.hold_while_behind(lambda: DEFAULT_TIMING.provisioning_deadline)  # its gateway far behind
    for sched in (full, held):
        sched.dispatcher.loop.idle = True  # as it was when the submission came
        handler = asyncio.get_running_loop().create_task(sched.submit_many([(spec(), None)], actor="op"))
        await until(lambda d=sched.dispatcher: bool(d._handed), "the submission is handed to the dispatcher")  # type: ignore[misc]
        outcome = await sched.dispatch_once()
        assert outcome.window_full and outcome.submitted == []
        [(row, created)] = await asyncio.wait_for(handler, WAIT)
        assert created and (await store.get_task(row.id)).state == "queued"
        assert [s for s, _ in await txids(store, row.id)] == ["queued"]
    assert (await store.get_task(waiting)).state == "assigned"
    assert await task_count(store) == 3


async def test_a_stopped_pass_or_a_closed_scheduler_leaves_the_submission_to_its_handler(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stopping: a pass cancelled in its commit (stored, the answer lost), or a dispatcher
    closed with a submission handed to it and no pass taken yet. Its handler stores the tasks once."""
    await add_node(store, "n1", slots=4)
    real = store.dispatch

    async def stopped_after_commit(**kw: Any) -> Any:
        out = await real(**kw)
        if kw["submissions"]:
            raise asyncio.CancelledError
        return out

    monkeypatch.setattr(store, "dispatch", stopped_after_commit)
    sched = Scheduler(store, TIMING, server_id="a")
    loop = asyncio.get_running_loop().create_task(sched.dispatcher.loop.run())
    await until(lambda: sched.dispatcher.loop.idle, "the dispatch loop waits for a wake-up")
    [(row, created)] = await asyncio.wait_for(sched.submit_many([(spec(name="stopped"), None)], actor="op"), WAIT)
    assert created and row.name == "stopped"
    with pytest.raises(asyncio.CancelledError):
        await loop  # the loop itself stopped with its pass
    await sched.dispatcher.loop.close()
    assert (await store.get_task(row.id)).state == "assigned"  # what that pass committed

    monkeypatch.setattr(store, "dispatch", real)
    # only the close answers it: the handler's own bound on its wait is out of reach here
    monkeypatch.setattr("podium.scheduler.service.HANDED_WAIT", 3600.0)
    closed = Scheduler(store, TIMING, server_id="b")
    closed.dispatcher.loop.idle = True  # as it was when the submission came; no pass will run
    handler = asyncio.get_running_loop().create_task(closed.submit_many([(spec(name="closed"), None)], actor="op"))
    await until(lambda: bool(closed.dispatcher._handed), "the submission is handed to the dispatcher")
    await closed.close()
    [(row2, created)] = await asyncio.wait_for(handler, WAIT)
    assert created and (await store.get_task(row2.id)).state == "queued"
    assert await task_count(store) == 2


async def test_a_handler_that_stops_waiting_and_a_pass_that_stores_late_make_one_task(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass slower than its handler's wait: the handler stores the tasks itself, under the ids the
    pass was given; whichever insert comes second finds the first's row (the pass stores nothing and
    places the task next time, or the handler reads what the pass stored). One task either way."""
    await add_node(store, "n1", slots=4)
    real = store.dispatch
    slowed: list[bool] = []

    async def slow_once(**kw: Any) -> Any:
        if kw["submissions"] and not slowed:
            slowed.append(True)
            await asyncio.sleep(1.0)  # the handler's wait (below) ends long before
        return await real(**kw)

    monkeypatch.setattr(store, "dispatch", slow_once)
    monkeypatch.setattr("podium.scheduler.service.HANDED_WAIT", 0.05)
    caplog.set_level(logging.WARNING, logger="podium.scheduler.service")
    async with running(Scheduler(store, TIMING, server_id="a")) as sched:
        [(row, created)] = await asyncio.wait_for(sched.submit_many([(spec(name="late"), None)], actor="op"), WAIT)
        assert created and row.name == "late" and slowed == [True]
        assert "a dispatch pass given 1 new tasks did not answer within 0.05s; storing them on their own" in caplog.text
        await until_state(store, row.id, "assigned")
    assert await task_count(store) == 1
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM audit_log WHERE action = 'task.submit'") == 1
