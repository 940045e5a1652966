"""What wakes a dispatcher, and which wake-ups it need not answer with a pass, against real PostgreSQL:
a commit that only frees capacity says so (`ROOM_FREED`), one that queues a task does not; a
dispatcher whose last look found the queue drained runs no pass for room no task waits for, and
still looks for a task queued since, for room while a task waits, and at the whole window's tick."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import REGISTRY

from podium.scheduler.dispatch import WINDOW_POLL
from podium.scheduler.service import Scheduler
from podium.scheduler.woken import WokenLoop
from podium.spec import TaskSpec
from podium.states import AttemptState, TaskState
from podium.store import ROOM_FREED, Store
from podium.store.db import Change
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import (
    WAIT,
    add_node,
    ended,
    filled_under_a_pass,
    heard,
    submit,
    tick,
    to_running,
    until,
)

S = TaskState
# No pass of the loop's own (the tick) but the first: every other pass here is one a wake-up brought.
TIMING = dataclasses.replace(DEFAULT_TIMING, tick=3600.0)


def skipped() -> float:
    return REGISTRY.get_sample_value("podium_dispatch_skipped_total") or 0.0


@asynccontextmanager
async def running(sched: Scheduler) -> AsyncIterator[list[int]]:
    """The dispatch loop running, idle when this yields; the list counts the passes it ran."""
    d = sched.dispatcher
    passes = [0]
    inner = d.dispatch_once

    async def counted() -> Any:
        passes[0] += 1
        return await inner()

    d.dispatch_once = counted  # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(d.loop.run())
    try:
        await until(lambda: d.loop.idle, "the dispatch loop waits for a wake-up")
        passes[0] = 0  # its first pass, on starting
        yield passes
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await d.loop.close()


async def test_a_commit_says_whether_it_only_freed_room(store: Store) -> None:
    """An end frees capacity and queues nothing: 'room'. A failed attempt whose task goes back to the
    queue, and a submission, queue a task: any other word. The commit of ends that placed on its room
    says 'room' for what its placements left free once the queue is drained."""
    await add_node(store, "n1", slots=4)
    sched = Scheduler(store, TIMING, server_id="test")
    tasks = [await submit(store) for _ in range(3)]
    await tick(store, sched)
    sub = await store.listen("podium_dispatch")
    try:
        assert await heard(store, sub) == []
        node, tok = await to_running(store, tasks[0])
        assert await heard(store, sub) == []  # an acceptance and a start free nothing
        await store.transition_decided([tasks[0]], ended(tasks[0], node, tok))
        assert await heard(store, sub) == [ROOM_FREED]
        node, tok = await to_running(store, tasks[1])
        await store.transition_decided([tasks[1]], ended(tasks[1], node, tok, to=S.QUEUED))
        assert (await store.get_task(tasks[1])).state == S.QUEUED
        assert await heard(store, sub) == [""]  # freed, and a task queued: a pass must look
        await submit(store)
        assert await heard(store, sub) == [""]
        # a commit of ends placing on the room it frees: the queue (the two tasks above) drained, a
        # slot left free on the node
        await tick(store, sched)
        node, tok = await to_running(store, tasks[2])
        assert sched.dispatcher.refill() is None  # the fleet was not full: no commit of ends places anything
        # as if the last pass had left the fleet full with tasks waiting
        sched.dispatcher._left_full = sched.dispatcher._queued_maybe = True
        refill = sched.dispatcher.refill()
        assert refill is not None
        await store.transition_decided([tasks[2]], ended(tasks[2], node, tok), refill=refill)
        assert refill.outcome is not None and refill.outcome.assigned == [] and refill.room_left
        assert await heard(store, sub) == [ROOM_FREED]
    finally:
        await sub.close()


async def test_an_end_on_a_drained_queue_runs_no_pass_and_a_task_queued_since_is_placed(store: Store) -> None:
    """One task at a time on an idle fleet: the pass that placed it drained the queue, so its end's
    wake-up (room, and nothing else) is answered with no pass, where each was a transaction of its own.
    A task queued after that wakes the dispatcher with its own word, and is placed."""
    await add_node(store, "n1", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    async with running(sched) as passes:
        [(row, created)] = await sched.submit_many([(TaskSpec(command=["true"]), None)], actor="op")
        assert created and (await store.get_task(row.id)).state == S.ASSIGNED
        assert passes[0] == 1 and not d._queued_maybe
        await until(lambda: d.loop.idle, "the dispatch loop waits for a wake-up")
        node, tok = await to_running(store, row.id)
        before = skipped()
        await store.transition_decided([row.id], ended(row.id, node, tok))
        await until(lambda: skipped() == before + 1, "the end's wake-up was heard and answered")
        assert passes[0] == 1  # no pass for it
        # stored by a handler of its own (as when the dispatcher is busy), or by another server
        late = await submit(store)
        await until(lambda: passes[0] == 2, "a pass for the task queued since")
        await until(lambda: d.loop.idle, "the pass ended")
        assert (await store.get_task(late)).state == S.ASSIGNED
        assert skipped() == before + 1


async def test_room_freed_while_a_task_waits_is_looked_at(store: Store) -> None:
    """A task the last pass could not place (the node full) is placed by the pass the end's 'room'
    brings: the dispatcher knows a task may wait (and the fleet full, it settles before that pass)."""
    await add_node(store, "n1", slots=1)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    async with running(sched) as passes:
        [(first, _)] = await sched.submit_many([(TaskSpec(command=["true"]), None)], actor="op")
        await until(lambda: d.loop.idle, "the dispatch loop waits for a wake-up")
        [(second, _)] = await sched.submit_many([(TaskSpec(command=["true"]), None)], actor="op")
        assert (await store.get_task(second.id)).state == S.QUEUED  # no room for it: stored, left queued
        assert d._queued_maybe
        await until(lambda: d.loop.idle, "the dispatch loop waits for a wake-up")
        ran, before = passes[0], skipped()
        node, tok = await to_running(store, first.id)
        await store.transition_decided([first.id], ended(first.id, node, tok))
        await until(lambda: passes[0] > ran, "a pass for the room the end freed")
        await until(lambda: d.loop.idle, "the pass ended")
        placed = await store.get_task(second.id)
        assert (placed.state, placed.node_id) == (S.ASSIGNED, "n1")
        assert skipped() == before


async def test_a_refill_that_drained_the_queue_does_not_hide_a_task_a_pass_left_waiting_since(store: Store) -> None:
    """A commit of ends places on its room and its claim drains the queue; before that commit is
    answered, a pass claims tasks stored since and leaves one waiting (the fleet full again). The
    commit's "drained" is older than the pass's word: the task is still known to wait, so the next
    end's commit places it on the room it frees, and an end's wake-up is answered with a pass. (Believed,
    the stale "drained" had every end after it place nothing and wake no pass: a burst of real agents
    idled until the tick.) With nothing between, a refill's drained queue is still believed."""
    await add_node(store, "n1", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    a, b = await submit(store), await submit(store)
    await tick(store, sched)  # both placed: the fleet full
    c = await submit(store)
    await tick(store, sched)
    assert (await store.get_task(c)).state == S.QUEUED and d._left_full and d._queued_maybe
    (na, ta), (nb, tb) = await to_running(store, a), await to_running(store, b)

    def both_end(rows: Any) -> list[Any]:
        return [*ended(a, na, ta)(rows), *ended(b, nb, tb)(rows)]

    refill = d.refill()  # a commit of a's and b's ends places on their room: room for two, `c` alone queued
    assert refill is not None
    await store.transition_decided([a, b], both_end, refill=refill)
    assert refill.outcome is not None and len(refill.outcome.assigned) == 1 and refill.plan.drained
    assert (await store.get_task(c)).state == S.ASSIGNED
    # before that commit's answer reaches the dispatcher: two tasks stored since, one placed by a
    # pass on the room left, the other left waiting for room
    e, f = await submit(store), await submit(store)
    await tick(store, sched)
    assert (await store.get_task(e)).state == S.ASSIGNED and (await store.get_task(f)).state == S.QUEUED
    assert d._left_full
    d.refilled(refill)  # the commit's answer, after the pass's
    assert d._queued_maybe, "a task waits for room: the older drained claim must not hide it"
    d.loop.heard = frozenset({ROOM_FREED})
    assert not d._nothing_to_look_for()  # an end's wake-up is a pass's
    # the next end's commit places `f` on the room it frees
    (nc, tc) = await to_running(store, c)
    refill = d.refill()
    assert refill is not None
    await store.transition_decided([c], ended(c, nc, tc), refill=refill)
    d.refilled(refill)
    placed = await store.get_task(f)
    assert (placed.state, placed.node_id) == (S.ASSIGNED, "n1")
    assert not refill.plan.drained and d._queued_maybe  # it found as many as it asked for: more may wait
    # the control: the next end's commit finds the queue drained and nothing tells otherwise since:
    # believed, so no later commit of ends claims for nothing
    (ne, te) = await to_running(store, e)
    refill = d.refill()
    assert refill is not None
    await store.transition_decided([e], ended(e, ne, te), refill=refill)
    d.refilled(refill)
    assert refill.plan.drained and not d._queued_maybe
    assert d.refill() is None


async def test_a_claim_that_passed_over_a_held_task_does_not_take_the_queue_for_drained(store: Store) -> None:
    """A queued task whose row another transaction holds (a release proof's, a group commit's reading
    a stale report, another replica's claim) is passed over by the claim (SKIP LOCKED), which then
    comes up short. That is no drained queue: the task is still known to wait, so the wake-up of the
    room an end frees is a pass's. Believed drained, such a wake-up was answered with no pass and the
    task waited for the tick. The control: a short claim that passed over nothing still drains it."""
    await add_node(store, "n1", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    await tick(store, sched)  # nothing queued: drained, the whole window looked at just now
    assert not d._queued_maybe
    t = await submit(store)
    async with store.pool.acquire() as holder, holder.transaction():
        await holder.execute("SELECT id FROM tasks WHERE id = $1 FOR NO KEY UPDATE", t)
        out = await tick(store, sched)
        assert (await store.get_task(t)).state == S.QUEUED
    assert d._queued_maybe, "a task another transaction held is still queued: the queue is not drained"
    assert out.held and out.claimed == 0
    d.loop.heard = frozenset({ROOM_FREED})
    assert not d._nothing_to_look_for()  # an end's wake-up is a pass's
    out = await tick(store, sched)
    assert not out.held and [tid for tid, _n, _tok in out.assigned] == [t]
    # the control: nothing queued, nothing held: drained, and believed
    out = await tick(store, sched)
    assert out.claimed == 0 and not out.held and not d._queued_maybe


async def test_a_pass_that_passed_over_a_held_task_looks_again_though_nothing_wakes_it(store: Store) -> None:
    """The holder's commit may say nothing (a group commit that read the task for a stale report and
    changed nothing): a running dispatcher whose pass passed over a held task looks again shortly, and
    places the task once it is let go, with no notification and long before the tick (an hour here)."""
    await add_node(store, "n1", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    t = await submit(store)
    async with store.pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        held = True
        try:
            await holder.execute("SELECT id FROM tasks WHERE id = $1 FOR NO KEY UPDATE", t)
            async with running(sched) as passes:
                await until(lambda: passes[0] >= 1, "a pass after the one that passed over the held task")
                assert (await store.get_task(t)).state == S.QUEUED
                await tx.commit()  # let go, and nothing said
                held = False
                deadline = asyncio.get_running_loop().time() + WAIT
                while (await store.get_task(t)).state == S.QUEUED:
                    assert asyncio.get_running_loop().time() < deadline, "the task let go was never placed"
                    await asyncio.sleep(0.01)
        finally:
            if held:
                await tx.rollback()
    assert (await store.get_task(t)).node_id == "n1"


async def test_a_pass_whose_placement_lost_its_node_to_another_scheduler_looks_again_soon(
    store: Store, db_url: str
) -> None:
    """Another scheduler (a replica, a commit of ends) fills the node a pass placed on between the
    pass's read of the nodes and its write: the reservation is refused and the task stays queued.
    That is no drained queue, though the claim came up short; and nothing wakes the dispatcher for it
    (the other scheduler's commit freed nothing), so the pass asks for the next within 20 ms, which
    places the task on the node as it is then. Before, the dispatcher took the queue for drained and waited
    for the tick."""
    await add_node(store, "n1", slots=2)
    await add_node(store, "n2", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    await tick(store, sched)
    t = await submit(store)
    again = await filled_under_a_pass(store, db_url, ["n1", "n2"], d._pass)
    assert (await store.get_task(t)).state == S.QUEUED  # its reservation refused: the node was full
    assert d._queued_maybe, "the task it could not place is still queued: the queue is not drained"
    assert again == WINDOW_POLL, "a pass that lost a node to another scheduler looks again soon, not at the tick"
    # room again on n2 (the other scheduler's task ended there): the next pass places it
    async with store.pool.acquire() as c:
        await c.execute("UPDATE nodes SET res_slots = 0 WHERE id = 'n2'")
    out = await tick(store, sched)
    assert out.lost_races == 0 and [(tid, n) for tid, n, _tok in out.assigned] == [(t, "n2")]


async def _moved(store: Store, tid: Any, to: TaskState) -> None:
    """The task's acceptance (`to` provisioning) or start (`to` running) as the policy makes it from its
    node's report: the attempt moved with it."""
    t = await store.get_task(tid)
    from_ = S.ASSIGNED if to == S.PROVISIONING else S.PROVISIONING
    assert await store.transition_task(tid, from_, to, actor=f"node:{t.node_id}", fencing_token=t.fencing_token,
                                       node_id=t.node_id, attempt_state=AttemptState(str(to)))  # fmt: skip


async def test_a_start_that_frees_an_operation_a_task_waits_for_wakes_a_pass(store: Store) -> None:
    """A node that prepares one task at a time (`--max-operations 1`, 4 slots): the second task waits
    for the first one's start, not for a slot. The start says so ('room'), made alone or in a commit of
    ends that places on the room its ends free (which places on those nodes only); an acceptance frees
    no operation, and on a node whose slots bind first a start wakes no one (the first test). Before,
    the waiting task was placed at the tick."""
    await add_node(store, "n1", slots=4, max_operations=1)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    a, b, c = await submit(store), await submit(store), await submit(store)
    await tick(store, sched)
    assert [(await store.get_task(t)).state for t in (a, b, c)] == [S.ASSIGNED, S.QUEUED, S.QUEUED]
    assert d._queued_maybe
    sub = await store.listen("podium_dispatch")
    try:
        await _moved(store, a, S.PROVISIONING)
        assert await heard(store, sub) == []  # an acceptance frees no operation
        await _moved(store, a, S.RUNNING)
        assert await heard(store, sub) == [ROOM_FREED]
        await tick(store, sched)  # the pass that wake-up brings
        assert [(await store.get_task(t)).state for t in (b, c)] == [S.ASSIGNED, S.QUEUED]
        # b's start in a group commit that places on the room its ends free (none end here): the
        # commit's own word, the statement's being left to it
        await _moved(store, b, S.PROVISIONING)
        d._left_full = d._queued_maybe = True
        refill = d.refill()
        assert refill is not None
        tb = await store.get_task(b)
        start = Change(b, S.PROVISIONING, S.RUNNING, actor="node:n1", fencing_token=tb.fencing_token, node_id="n1",
                       attempt_state=AttemptState.RUNNING)  # fmt: skip
        await store.transition_decided([b], lambda rows: [start], refill=refill)
        assert (await store.get_task(b)).state == S.RUNNING
        assert await heard(store, sub) == [ROOM_FREED]
    finally:
        await sub.close()


async def test_a_node_that_talks_again_wakes_a_pass(store: Store) -> None:
    """A node marked unreachable (no heartbeat for a while) that heartbeats again is online again: a
    task that waited for a node is a pass's to place now ('': a node changed), not at the tick. The
    heartbeats of a node that was online say nothing (a fleet heartbeats all the time)."""
    row = await add_node(store, "n1", slots=2)
    sub = await store.listen("podium_dispatch")
    try:
        assert await store.heartbeats([("n1", row.session)], "test") == {"n1"}
        assert await heard(store, sub) == []
        async with store.pool.acquire() as c:  # its last heartbeat an hour ago, as the watchdog then sees it
            await c.execute("UPDATE nodes SET last_heartbeat_at = now() - interval '1 hour' WHERE id = 'n1'")
        assert await store.mark_unreachable(60.0) == ["n1"]
        assert await heard(store, sub) == []
        assert await store.heartbeats([("n1", row.session)], "test") == {"n1"}
        assert await heard(store, sub) == [""]
        async with store.pool.acquire() as c:
            assert await c.fetchval("SELECT health FROM nodes WHERE id = 'n1'") == "online"
        assert await store.heartbeats([("n1", row.session)], "test") == {"n1"}
        assert await heard(store, sub) == []
    finally:
        await sub.close()


async def test_which_wake_ups_need_no_pass(store: Store) -> None:
    """The rule itself, on a real dispatcher: only 'room', with the queue drained, nothing handed to
    it, and the whole window's look not due."""
    await add_node(store, "n1", slots=2)
    sched = Scheduler(store, TIMING, server_id="test")
    d = sched.dispatcher
    await tick(store, sched)  # an empty queue: drained, the whole window looked at just now
    assert not d._queued_maybe
    for woke, expected in ((None, False), (frozenset({ROOM_FREED}), True), (frozenset({ROOM_FREED, ""}), False),
                           (frozenset({""}), False)):  # fmt: skip
        d.loop.heard = woke
        assert d._nothing_to_look_for() is expected, woke
    d.loop.heard = frozenset({ROOM_FREED})
    d._queued_maybe = True
    assert not d._nothing_to_look_for()  # a task may wait for that room
    d._queued_maybe = False
    d._window_looked_at -= TIMING.tick  # the whole window is due: every queued task told its reason
    assert not d._nothing_to_look_for()


async def test_a_woken_loop_says_what_woke_each_pass(store: Store) -> None:
    """`WokenLoop.heard`: the payloads heard since the last pass when notifications alone woke it;
    None when a poke did, or the last pass asked for this one."""
    seen: list[frozenset[str] | None] = []
    gate = [asyncio.Event() for _ in range(4)]
    again = [None, None, 0, None]

    async def run_pass() -> float | None:
        seen.append(woken.heard)
        n = len(seen) - 1
        gate[n].set()
        return again[n] if n < len(again) else None

    async def notify(*payloads: str) -> None:
        async with store.pool.acquire() as c, c.transaction():
            for p in payloads:
                await c.execute("SELECT pg_notify('podium_test_heard', $1)", p)

    woken = WokenLoop("test", store, "podium_test_heard", 3600.0, run_pass)
    task = asyncio.create_task(woken.run())
    try:
        await asyncio.wait_for(gate[0].wait(), WAIT)  # the first pass: nothing heard yet
        await until(lambda: woken.idle, "waiting for a wake-up")
        await notify("a")
        await asyncio.wait_for(gate[1].wait(), WAIT)
        await until(lambda: woken.idle, "waiting for a wake-up")
        woken.poke()
        await asyncio.wait_for(gate[2].wait(), WAIT)  # it asks for the next at once (0)
        await asyncio.wait_for(gate[3].wait(), WAIT)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await woken.close()
    assert seen == [None, frozenset({"a"}), None, None]


async def test_a_woken_loop_says_whether_anything_was_heard_before_a_poke(store: Store) -> None:
    """`WokenLoop.quiet`: true for a pass a poke woke with no notification heard since the last pass
    (the dispatcher places a handed submission before its transaction only then: a task another
    handler stored meanwhile says so); false when one was heard first, or woke the pass itself."""
    seen: list[bool] = []
    gate = [asyncio.Event() for _ in range(6)]
    hold = [asyncio.Event() for _ in range(6)]

    async def run_pass() -> float | None:
        seen.append(woken.quiet)
        n = len(seen) - 1
        gate[n].set()
        if n in (2, 3):
            await hold[n].wait()  # busy, while what follows comes
        return None

    async def notify(payload: str) -> None:
        async with store.pool.acquire() as c:
            await c.execute("SELECT pg_notify('podium_test_quiet', $1)", payload)

    woken = WokenLoop("test", store, "podium_test_quiet", 3600.0, run_pass)
    task = asyncio.create_task(woken.run())
    try:
        await asyncio.wait_for(gate[0].wait(), WAIT)  # the first pass: no wake-up at all
        await until(lambda: woken.idle, "waiting for a wake-up")
        woken.poke()  # nothing heard: quiet
        await asyncio.wait_for(gate[1].wait(), WAIT)
        await until(lambda: woken.idle, "waiting for a wake-up")
        await notify("")  # heard, and woke the pass itself (2), which is held busy
        await asyncio.wait_for(gate[2].wait(), WAIT)
        woken.poke()  # a poke alone while it is busy: the next pass (3) is quiet
        hold[2].set()
        await asyncio.wait_for(gate[3].wait(), WAIT)
        sub = woken._sub
        assert sub is not None
        await notify("")  # heard while pass 3 is busy, then a poke: pass 4 is not quiet
        await until(sub.pending, "the notification heard")
        woken.poke()
        hold[3].set()
        await asyncio.wait_for(gate[4].wait(), WAIT)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await woken.close()
    assert seen == [False, True, False, True, False]
