"""A group commit of ends places queued tasks on the room it frees, in its own transaction (`Refill`,
`Store.transition_decided`, `Dispatcher.refill`), against real PostgreSQL: the end and the next
assignment are one commit, made only on the freed nodes, never on one that may not be given work
or whose facts the dispatcher has not read, never past the window; a task that failed on a node is
not put back on it; a fault in placing costs the commit nothing of its ends."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from podium import reasons
from podium.scheduler.service import Scheduler
from podium.states import TaskState
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node, ended, heard, node_row, submit, tick, to_running

S = TaskState


def _scheduler(store: Store, **timing: Any) -> Scheduler:
    # a tick of an hour: only the first pass looks at the whole window
    return Scheduler(store, dataclasses.replace(DEFAULT_TIMING, tick=3600.0, **timing), server_id="test")


async def _xmin(store: Store, tid: uuid.UUID) -> int:
    async with store.pool.acquire() as c:
        return int(await c.fetchval("SELECT xmin::text::bigint FROM tasks WHERE id = $1", tid))


async def _full_fleet(store: Store, queued: int = 1) -> tuple[Scheduler, list[uuid.UUID], list[uuid.UUID]]:
    """Two nodes of one slot each, both running a task, and `queued` tasks waiting for room: the
    scheduler (whose last pass left the fleet full), the running tasks and the queued ones."""
    await add_node(store, "n1", slots=1)
    await add_node(store, "n2", slots=1)
    sched = _scheduler(store)
    running = [await submit(store) for _ in range(2)]
    waiting = [await submit(store) for _ in range(queued)]
    placed = await tick(store, sched)  # the whole window: each task left queued is told why
    assert [a[0] for a in placed.assigned] == running and sched.dispatcher._left_full
    for tid in running:
        await to_running(store, tid)
    for tid in waiting:
        t = await store.get_task(tid)
        assert t.state == S.QUEUED and t.reason == reasons.FULL
    return sched, running, waiting


async def test_an_end_assigns_the_next_queued_task_to_its_node_in_its_own_commit(store: Store) -> None:
    sched, running, [next_] = await _full_fleet(store)
    t = await store.get_task(running[0])
    assert t.node_id is not None and t.fencing_token is not None
    refill = sched.dispatcher.refill()
    assert refill is not None
    _changes, results = await store.transition_decided([t.id], ended(t.id, t.node_id, t.fencing_token), refill=refill)
    assert results[0] is not None
    out = refill.outcome
    assert out is not None and [(a[0], a[1]) for a in out.assigned] == [(next_, t.node_id)]
    # its Assign is the caller's to push (the node's stream is here), with the spec and attempt it carries
    assert [(o.kind, o.node_id, o.task_id, o.attempt) for o in out.delivered] == [("assign", t.node_id, next_, 1)]
    after = await store.get_task(next_)
    assert (after.state, after.node_id, after.reason) == (S.ASSIGNED, t.node_id, None)
    assert (await store.get_task(t.id)).state == S.SUCCEEDED
    # one commit: the end and the assignment were written by the same transaction
    assert await _xmin(store, t.id) == await _xmin(store, next_)
    n = await node_row(store, t.node_id)
    assert n["res_slots"] == 1  # the end gave its slot back, the assignment took it
    async with store.pool.acquire() as c:
        attempt = await c.fetchrow("SELECT * FROM attempts WHERE task_id = $1", next_)
    assert attempt["state"] == "assigned" and attempt["delivered_at"] is not None
    assert attempt["fencing_token"] == out.assigned[0][2]
    sched.dispatcher.refilled(refill)
    # It claimed all it asked for: more may wait. The next end's claim finds the queue empty, and
    # the commits of ends after it claim nothing more (until a pass leaves the fleet full again).
    other = await store.get_task(running[1])
    assert other.node_id is not None and other.fencing_token is not None
    again = sched.dispatcher.refill()
    assert again is not None
    await store.transition_decided([other.id], ended(other.id, other.node_id, other.fencing_token), refill=again)
    assert again.outcome is not None and (again.outcome.claimed, again.outcome.assigned) == (0, [])
    sched.dispatcher.refilled(again)
    assert sched.dispatcher.refill() is None


async def test_only_the_freed_nodes_are_placed_on_and_only_what_their_room_takes(store: Store) -> None:
    """Two tasks wait; one end frees one slot on one node: one task is placed there, the other keeps
    its reason (a commit of ends sees only the nodes it freed: it does not know the true reason of a
    task it cannot place), and the dispatcher still knows tasks wait."""
    sched, running, waiting = await _full_fleet(store, queued=2)
    t = await store.get_task(running[1])
    assert t.node_id is not None and t.fencing_token is not None
    refill = sched.dispatcher.refill()
    assert refill is not None
    await store.transition_decided([t.id], ended(t.id, t.node_id, t.fencing_token), refill=refill)
    assert refill.outcome is not None
    assert [(a[0], a[1]) for a in refill.outcome.assigned] == [(waiting[0], t.node_id)]  # the oldest first
    assert refill.outcome.claimed == 1  # no more than the room could take
    left = await store.get_task(waiting[1])
    assert (left.state, left.reason) == (S.QUEUED, reasons.FULL)
    sched.dispatcher.refilled(refill)
    assert sched.dispatcher.refill() is not None


async def test_a_node_that_may_not_be_given_work_or_changed_since_the_dispatcher_read_it_is_not_placed_on(store: Store) -> None:
    sched, running, [next_] = await _full_fleet(store)
    draining, relabelled = [await store.get_task(tid) for tid in running]
    assert draining.node_id and draining.fencing_token and relabelled.node_id and relabelled.fencing_token
    await store.set_draining(draining.node_id, True)
    await store.set_labels(relabelled.node_id, {"zone": "b"})  # its facts change: the dispatcher has not read them
    for t in (draining, relabelled):
        assert t.node_id is not None and t.fencing_token is not None
        refill = sched.dispatcher.refill()
        assert refill is not None
        _changes, results = await store.transition_decided([t.id], ended(t.id, t.node_id, t.fencing_token), refill=refill)
        assert results[0] is not None and refill.outcome is None  # the end is made; nothing placed
        assert (await node_row(store, t.node_id))["res_slots"] == 0
    after = await store.get_task(next_)
    assert (after.state, after.reason) == (S.QUEUED, reasons.FULL)
    # the pass the ends wake reads the relabelled node and places there
    out = await tick(store, sched)
    assert [(a[0], a[1]) for a in out.assigned] == [(next_, relabelled.node_id)]


async def test_a_task_that_failed_on_a_node_is_not_put_back_on_it_by_that_nodes_end(store: Store) -> None:
    """A failed attempt requeued in the end that frees its node: placement tries other nodes first,
    which a commit that sees the freed node alone cannot do. The task is left to the next pass."""
    sched, running, waiting = await _full_fleet(store, queued=0)
    t = await store.get_task(running[0])
    assert t.node_id is not None and t.fencing_token is not None
    sched.dispatcher._queued_maybe = True  # as after a pass that left tasks waiting
    refill = sched.dispatcher.refill()
    assert refill is not None
    _changes, results = await store.transition_decided([t.id], ended(t.id, t.node_id, t.fencing_token, S.QUEUED), refill=refill)
    assert results[0] is not None
    assert refill.outcome is not None and refill.outcome.assigned == [] and set(refill.outcome.unplaced) == {t.id}
    after = await store.get_task(t.id)
    assert (after.state, after.node_id) == (S.QUEUED, None)
    assert (await node_row(store, t.node_id))["res_slots"] == 0


async def test_a_window_full_of_unaccepted_assignments_places_nothing_on_the_freed_room(store: Store) -> None:
    await add_node(store, "n1", slots=1)
    await add_node(store, "n2", slots=1)
    sched = _scheduler(store, assign_window=1)
    first = await submit(store)
    await tick(store, sched)
    node, tok = await to_running(store, first)  # accepted: out of the window
    second, third = await submit(store), await submit(store)
    out = await tick(store, sched)
    assert [a[0] for a in out.assigned] == [second]  # on the other node, not accepted: the window is full
    assert sched.dispatcher._left_full
    refill = sched.dispatcher.refill()
    assert refill is not None
    await store.transition_decided([first], ended(first, node, tok), refill=refill)
    assert refill.outcome is not None and refill.outcome.window_full and refill.outcome.assigned == []
    assert (await store.get_task(third)).state == S.QUEUED


async def test_a_fault_in_placing_costs_the_commit_nothing_of_its_ends(store: Store, monkeypatch: Any) -> None:
    sched, running, [next_] = await _full_fleet(store)
    t = await store.get_task(running[0])
    assert t.node_id is not None and t.fencing_token is not None
    refill = sched.dispatcher.refill()
    assert refill is not None

    def broken(_t: Any) -> Any:
        raise RuntimeError("a fault in placement")

    monkeypatch.setattr(sched.dispatcher, "requirements_of", broken)
    _changes, results = await store.transition_decided([t.id], ended(t.id, t.node_id, t.fencing_token), refill=refill)
    assert results[0] is not None and (await store.get_task(t.id)).state == S.SUCCEEDED
    assert refill.outcome is not None and refill.outcome.assigned == []
    after = await store.get_task(next_)
    assert (after.state, after.reason) == (S.QUEUED, reasons.FULL)
    assert (await node_row(store, t.node_id))["res_slots"] == 0


async def test_the_dispatcher_offers_no_refill_it_should_not_make(store: Store) -> None:
    """Before its first read of the nodes, after a pass that left room, while its gateway is behind,
    and once it is stopping, a commit of ends places nothing."""
    from podium.scheduler.dispatch import HOLD_SHARE

    await add_node(store, "n1", slots=2)
    sched = _scheduler(store)
    d = sched.dispatcher
    assert d.refill() is None  # no node read yet
    tid = await submit(store)
    await tick(store, sched)
    assert not d._left_full and d.refill() is None  # the pass placed all it claimed, with room to spare
    await submit(store)
    await submit(store)
    await tick(store, sched)
    assert d._left_full and d.refill() is not None
    behind = [DEFAULT_TIMING.provisioning_deadline * HOLD_SHARE + 1]
    sched.hold_while_behind(lambda: behind[0])
    assert d.refill() is None
    behind[0] = 0.0
    assert d.refill() is not None
    await sched.close()
    assert d.refill() is None
    assert (await store.get_task(tid)).state == S.ASSIGNED


async def test_the_report_batcher_places_on_the_room_its_ends_free_and_pushes_the_assigns_once_committed(store: Store) -> None:
    """The gateway's own group commit, given the dispatcher (`ReportBatcher.place_on_ends`): a node's
    end is acknowledged, and the next queued task's Assign handed to the outbox's push, once the one
    commit that made both is known."""
    import asyncio
    import contextlib

    from podium import metrics
    from podium.gateway.liveness import LogFlusher
    from podium.gateway.reports import ReportBatcher
    from podium.gateway.sessions import Session, Sessions
    from podium.proto.podium.v1 import agent_pb2 as pb
    from podium.store.rows import OutboxRow

    sched, running, [next_] = await _full_fleet(store)
    t = await store.get_task(running[0])
    assert t.node_id is not None and t.fencing_token is not None
    sessions = Sessions()
    s = Session(t.node_id, 1)
    sessions[t.node_id] = s
    batcher = ReportBatcher(store, sessions, DEFAULT_TIMING, logs=LogFlusher(store, sessions))
    pushed: list[OutboxRow] = []
    batcher.place_on_ends(sched.dispatcher, pushed.extend)
    before = metrics.REFILL_PLACEMENTS._value.get()
    loop = asyncio.create_task(batcher.loop())
    try:
        await batcher.enqueue(s, pb.TaskEvent(task_id=str(t.id), fencing_token=t.fencing_token, kind=pb.TaskEvent.Kind.EXITED))
        deadline = asyncio.get_running_loop().time() + 30
        while not pushed:
            assert asyncio.get_running_loop().time() < deadline, "no Assign pushed"
            await asyncio.sleep(0.01)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    assert [(o.kind, o.node_id, o.task_id) for o in pushed] == [("assign", t.node_id, next_)]
    acks = []
    while not s.out.empty():
        m = s.out.get_nowait()
        if m is not None and m.WhichOneof("kind") == "ack":
            acks.append(m.ack.task_id)
    assert acks == [str(t.id)]
    assert (await store.get_task(t.id)).state == S.SUCCEEDED
    assert (await store.get_task(next_)).state == S.ASSIGNED
    assert metrics.REFILL_PLACEMENTS._value.get() == before + 1


async def test_a_pass_under_way_leaves_the_last_passs_word_on_a_full_fleet(store: Store) -> None:
    """A commit of ends may ask while a pass runs (a good share of a burst): it is told what the last
    pass left, not 'not full' for the pass's length."""
    import asyncio

    sched, _running_, _waiting = await _full_fleet(store)
    d = sched.dispatcher
    dispatch = store.dispatch
    started, go = asyncio.Event(), asyncio.Event()

    async def slow(**kwargs: Any) -> Any:
        started.set()
        await go.wait()
        return await dispatch(**kwargs)

    store.dispatch = slow  # type: ignore[method-assign]
    under_way = asyncio.create_task(sched.dispatch_once())
    await asyncio.wait_for(started.wait(), 30)
    assert d.refill() is not None
    go.set()
    out = await under_way
    assert out.assigned == [] and d.refill() is not None  # still full


async def test_a_pass_is_woken_only_for_what_a_commits_own_placements_left(store: Store) -> None:
    """A commit that placed on all the room its ends freed wakes no dispatcher (woken by every such
    commit, passes ran a whole burst long to find no room); one whose placements left room wakes them,
    as does an end made with no placement at all."""
    sched, running, [next_] = await _full_fleet(store)
    sub = await store.listen("podium_dispatch")
    try:
        assert not await heard(store, sub)
        first, second = [await store.get_task(tid) for tid in running]
        assert first.node_id and first.fencing_token and second.node_id and second.fencing_token
        refill = sched.dispatcher.refill()
        assert refill is not None
        await store.transition_decided([first.id], ended(first.id, first.node_id, first.fencing_token), refill=refill)
        assert refill.outcome is not None and [a[0] for a in refill.outcome.assigned] == [next_]
        assert not await heard(store, sub)  # the freed slot is taken: nothing for a pass
        again = sched.dispatcher.refill()
        assert again is not None
        await store.transition_decided([second.id], ended(second.id, second.node_id, second.fencing_token), refill=again)
        assert again.outcome is not None and again.outcome.assigned == []
        assert await heard(store, sub)  # the queue is drained: the freed slot is a pass's to fill
        # an end made with no placement wakes them as it always did
        [(tid, tok)] = [(a[0], a[2]) for a in refill.outcome.assigned]
        await to_running(store, tid)
        await store.transition_decided([tid], ended(tid, first.node_id, tok))
        assert await heard(store, sub)
    finally:
        await sub.close()
