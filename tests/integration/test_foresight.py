"""A submission handed to an idle dispatcher whose last look found the queue drained is placed
before its pass's transaction: its Assign travels to its node while the pass stores, claims and
writes, the claim takes the node's lock when it finds nothing else queued, and an acceptance the node
sent back meanwhile is made by the pass's write. What a queued task that came first does to that
placement. Real PostgreSQL; the gateway's report batcher; a node's stream stood in for by the
gateway's `Session`."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from podium import reasons
from podium.gateway.service import Gateway
from podium.gateway.sessions import Session
from podium.scheduler.apply import Applier
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.db import DispatchOutcome
from podium.store.queries import queries
from podium.store.rows import TaskRow
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import Statements, add_node, looping, submit, until
from tests.integration.test_delivery import _event_transactions, _eventually, _provisioning, sent


@contextlib.asynccontextmanager
async def wired(store: Store) -> AsyncIterator[tuple[Gateway, Scheduler, Session, list[str], list[Any]]]:
    """A gateway and a scheduler wired as the server wires them, one node "n1" whose stream is the
    `Session`, the report batcher running; the statements the store runs and the gateway's offers in
    `order` (from the dispatcher's first look on), and the Assign rows offered. The dispatcher has
    looked once and found the queue drained, as a server's does between tasks run one at a time."""
    sec = Security(store, SecretBox(os.urandom(32)))
    gw = Gateway(store, Applier(store, actor="gateway:test"), DEFAULT_TIMING, server_id="test", security=sec)
    sched = Scheduler(store, DEFAULT_TIMING, server_id="test")
    sched.deliver_through(gw.sessions.keys, gw.outbox.push, gw)
    s = gw.sessions["n1"] = Session("n1", 1)
    order: list[str] = []
    offered_rows: list[Any] = []
    offer = gw.push_before_commit

    def offered(rows: list[Any]) -> bool:
        order.append("offer")
        offered_rows.extend(rows)
        return offer(rows)

    gw.push_before_commit = offered  # type: ignore[method-assign]
    # the dispatcher's LISTEN, as its running loop holds it (what it has heard and not taken yet is
    # what `still_foreseen` asks about)
    sched.dispatcher.loop._sub = await store.listen("podium_dispatch")
    try:
        async with looping(gw.reports.loop()):
            out = await sched.dispatch_once()
            assert out.claimed == 0 and not sched.dispatcher._queued_maybe, "the first look finds the queue drained"
            store.q = Statements(store.q, order)
            yield gw, sched, s, order, offered_rows
    finally:
        await sched.dispatcher.loop.close()


async def handed(
    sched: Scheduler, *specs: TaskSpec, quiet: bool = True, heard: bool = False
) -> tuple[DispatchOutcome, list[TaskRow]]:
    """The submission of `specs` handed to the dispatcher as its idle loop takes one, and the pass it
    wakes: what that pass did, and the tasks as it stored them. Unless `heard`, the notifications its
    LISTEN has heard are taken first, as its loop's last pass would have."""
    if not heard:
        assert sched.dispatcher.loop._sub is not None
        sched.dispatcher.loop._sub.drain()
    sub = sched.store.submissions([(spec, None) for spec in specs], actor="op")
    sched.dispatcher.loop.idle = True  # as its loop is between passes, waiting for a wake-up
    fut = sched.dispatcher.take_submission(sub)
    sched.dispatcher.loop.quiet = quiet  # woken by that poke, with nothing heard since the last pass or not
    assert fut is not None
    out = await sched.dispatcher.dispatch_once()
    stored = await fut
    assert stored is not None
    return out, [stored[i] for i in sub.ids]


def answering_before_the_write(gw: Gateway, s: Session) -> list[int]:
    """The node answers each Assign sent early with its `provisioning`, which the gateway has read
    by the time the pass asks for the acceptances that came back before its write: the tokens."""
    ask = gw.accepted_before_write
    answered: list[int] = []

    async def asked(tokens: list[int]) -> Any:
        for row in list(s.out._queue):  # type: ignore[attr-defined]  # what the stream would have written
            if row is not None and row.WhichOneof("kind") == "assign" and row.assign.fencing_token in tokens:
                answered.append(row.assign.fencing_token)
                await gw.reports.enqueue(s, _provisioning(row.assign.task_id, row.assign.fencing_token))
        return await ask(tokens)

    gw.accepted_before_write = asked  # type: ignore[method-assign]
    return answered


def answering_late(gw: Gateway) -> None:
    """The node's `provisioning` comes only after the pass's wait before its write (a slow node): the
    pass commits the assignment alone, and a group commit makes the acceptance after it."""

    async def nothing_in_time(tokens: list[int]) -> Any:
        return []

    gw.accepted_before_write = nothing_in_time  # type: ignore[method-assign]


async def stored_unheard(store: Store) -> uuid.UUID:
    """A task stored by a handler whose commit's NOTIFY the dispatcher has not heard yet (no NOTIFY)."""
    sub = store.submissions([(TaskSpec(command=["true"]), None)], actor="op")
    async with store.pool.acquire() as c:
        await c.fetch(queries()["insert_tasks"], sub.rows, reasons.WAITING, "op", False)
    return sub.ids[0]


async def _rows(store: Store, tid: uuid.UUID) -> tuple[Any, Any, list[Any]]:
    """What a task's acceptance leaves, but for times and ids: its row, its attempt's, its events."""
    async with store.pool.acquire() as c:
        task = await c.fetchrow(
            "SELECT state, revision, reason, reason_detail, node_id, attempts, exit_code, started_at, finished_at,"
            " accept_deadline IS NULL AS no_deadline, lease_expires_at > now() + interval '1 minute' AS leased,"
            " cancel_requested_at, fencing_token FROM tasks WHERE id = $1", tid)  # fmt: skip
        attempt = await c.fetchrow(
            "SELECT state, attempt, node_id, accept_deadline IS NOT NULL AS had_deadline,"
            " provisioning_at IS NOT NULL AS provisioned, delivered_at IS NOT NULL AS delivered, started_at,"
            " finished_at, retry_count, retry_limit, backend_kind, fencing_token FROM attempts WHERE task_id = $1", tid)  # fmt: skip
        events = await c.fetch(
            "SELECT from_state, to_state, reason, actor, fencing_token FROM task_events WHERE task_id = $1 ORDER BY id", tid
        )
    assert task is not None and attempt is not None
    assert attempt["fencing_token"] == task["fencing_token"]
    token = task["fencing_token"]
    return (
        {k: v for k, v in task.items() if k != "fencing_token"},
        {k: v for k, v in attempt.items() if k != "fencing_token"},
        [(e["from_state"], e["to_state"], e["reason"], e["actor"], e["fencing_token"] == token if e["fencing_token"] else None)
         for e in events],
    )  # fmt: skip


def _pass(order: list[str]) -> list[str]:
    """The statements of the pass and the offers in `order`, from its first read on."""
    return order[order.index("dispatch_facts") :]


async def test_a_handed_task_is_assigned_before_its_pass_stores_it_and_an_acceptance_back_by_then_is_made_by_the_write(
    store: Store,
) -> None:
    await add_node(store, "n1", slots=4)
    async with wired(store) as (gw, sched, s, order, offered):
        answered = answering_before_the_write(gw, s)
        out, [row] = await handed(sched, TaskSpec(command=["true"]))
        steps = [o for o in _pass(order) if o in ("offer", "insert_tasks", "claim_queued", "insert_tasks_claiming", "lock_nodes",
                                                   "lock_nodes_drawing_tokens", "assign_tasks", "transition_tasks")]  # fmt: skip
        # the Assign before the task is even stored; the task stored, claimed and its node locked by one
        # statement; the acceptance in the write
        assert steps == ["offer", "insert_tasks_claiming", "assign_tasks"], order
        [assign] = [r for r in offered if r.task_id == row.id]
        assert answered == [assign.fencing_token] and out.accepted == answered
        assert out.assigned == [(row.id, "n1", assign.fencing_token)]
        t = await store.get_task(row.id)
        assert (t.state, t.node_id, t.fencing_token, t.attempts) == ("provisioning", "n1", assign.fencing_token, 1)
        task, attempt, events = await _rows(store, row.id)
        assert events == [(None, "queued", None, "op", None), ("queued", "assigned", None, "scheduler:test", True),
                          ("assigned", "provisioning", None, "node:n1", True)]  # fmt: skip
        tx = await _event_transactions(store, row.id)
        assert tx["queued"] == tx["assigned"] == tx["provisioning"], "stored, assigned and accepted in one commit"
        assert (attempt["state"], attempt["had_deadline"], attempt["provisioned"]) == ("provisioning", True, True)
        assert (task["no_deadline"], task["leased"]) == (True, True)
        # told to start once the commit is known, and sent its Assign once
        [acc] = sent(s, "accepted")
        assert (acc.task_id, acc.fencing_token) == (str(row.id), assign.fencing_token)
        assert [a.fencing_token for a in sent(s, "assign")] == [assign.fencing_token]
        assert gw.reports.backlog == 0 and not s.events, "nothing left for a group commit to decide"


async def test_an_acceptance_made_by_the_write_leaves_what_one_made_after_it_leaves(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    async with wired(store) as (gw, sched, s, order, offered):
        answering_before_the_write(gw, s)
        _out, [early] = await handed(sched, TaskSpec(command=["true"]))
        assert "transition_tasks" not in _pass(order)
        answering_late(gw)
        out, [late] = await handed(sched, TaskSpec(command=["true"]))
        assert out.accepted == [] and (await store.get_task(late.id)).state == "assigned"
        # the control: the acceptance made by a group commit of its own after the pass's
        [assign] = [r for r in offered if r.task_id == late.id]
        await gw.reports.enqueue(s, _provisioning(str(late.id), assign.fencing_token))
        await _eventually(lambda: _state_is(store, late.id, "provisioning"), what="the late acceptance")
        tx = await _event_transactions(store, late.id)
        assert tx["assigned"] != tx["provisioning"]
        assert (await store.get_task(early.id)).state == "provisioning"
        assert await _rows(store, early.id) == await _rows(store, late.id)


async def _state_is(store: Store, tid: uuid.UUID, state: str) -> bool:
    return (await store.get_task(tid)).state == state


async def test_a_handed_task_is_placed_as_foreseen_beside_a_queued_one_that_came_first_when_both_fit(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    async with wired(store) as (_gw, sched, s, order, offered):
        older = await stored_unheard(store)  # stored while the dispatcher looked elsewhere: not heard of yet
        out, [row] = await handed(sched, TaskSpec(command=["true"]))
        [assign] = [r for r in offered if r.task_id == row.id]
        assert _pass(order).index("offer") < _pass(order).index("insert_tasks_claiming")
        assert sorted(t for t, _n, _tok in out.assigned) == sorted([older, row.id])
        t = await store.get_task(row.id)
        assert (t.state, t.fencing_token) == ("assigned", assign.fencing_token), "the foreseen placement stood"
        assert (await store.get_task(older)).state == "assigned"
        assert "lock_nodes_drawing_tokens" in _pass(order), "the claim took no node's lock: another task came"
        assigns = sent(s, "assign")
        assert sorted(a.task_id for a in assigns) == sorted([str(older), str(row.id)]) and len(assigns) == 2


async def test_a_queued_task_that_came_first_gets_the_room_a_handed_one_was_foreseen_on_and_that_assign_is_stale(
    store: Store,
) -> None:
    await add_node(store, "n1", slots=1)
    async with wired(store) as (gw, sched, s, _order, offered):
        older = await stored_unheard(store)
        out, [row] = await handed(sched, TaskSpec(command=["true"]))
        [early] = [r for r in offered if r.task_id == row.id]
        # claim order decides: the task that was queued first has the one slot
        assert [(t, n) for t, n, _tok in out.assigned] == [(older, "n1")]
        t = await store.get_task(row.id)
        assert (t.state, t.node_id, t.fencing_token, t.attempts) == ("queued", None, None, 0)
        assert t.reason == reasons.WAITING, "not claimed: the room was the older task's"
        # the node answers the Assign it was sent early: no such attempt was written, so it is told to stop
        await gw.reports.enqueue(s, _provisioning(str(row.id), early.fencing_token))

        async def told() -> list[Any]:
            return [m for m in sent(s, "cancel") if m.fencing_token == early.fencing_token]

        [cancel] = await _eventually(told, what="the Cancel of the attempt that was never written")
        assert cancel.reason == "stale attempt"
        assert all(a.fencing_token != early.fencing_token for a in sent(s, "accepted"))
        assert (await store.get_task(row.id)).state == "queued"


async def test_no_task_is_foreseen_by_a_dispatcher_that_does_not_know_the_queue_drained(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    async with wired(store) as (_gw, sched, _s, order, _offered):
        sched.dispatcher._queued_maybe = True  # as after a pass that left a task queued
        out, [row] = await handed(sched, TaskSpec(command=["true"]))
        assert [t for t, _n, _tok in out.assigned] == [row.id]
        steps = [o for o in _pass(order) if o in ("offer", "insert_tasks_claiming", "lock_nodes_drawing_tokens")]
        assert steps == ["insert_tasks_claiming", "lock_nodes_drawing_tokens", "offer"], order
        # nor by one that heard something since its last look (a handler's task stored meanwhile)
        order.clear()
        sched.dispatcher._queued_maybe = False
        out, [row] = await handed(sched, TaskSpec(command=["true"]), quiet=False)
        assert [t for t, _n, _tok in out.assigned] == [row.id]
        steps = [o for o in _pass(order) if o in ("offer", "insert_tasks_claiming", "lock_nodes_drawing_tokens")]
        assert steps == ["insert_tasks_claiming", "lock_nodes_drawing_tokens", "offer"], order
        # nor when the notification is heard only once its pass has begun: it is asked again then
        order.clear()
        other = await submit(store)  # a handler's task, its NOTIFY on its way
        sub = sched.dispatcher.loop._sub
        assert sub is not None
        await until(sub.pending, "the handler's NOTIFY heard")
        out, rows = await handed(sched, TaskSpec(command=["true"]), heard=True)
        assert sorted(t for t, _n, _tok in out.assigned) == sorted([other, rows[0].id])
        steps = [o for o in _pass(order) if o in ("offer", "insert_tasks_claiming", "lock_nodes_drawing_tokens")]
        assert steps == ["insert_tasks_claiming", "lock_nodes_drawing_tokens", "offer"], order


async def test_a_claim_takes_the_foreseen_nodes_locks_only_when_it_finds_nothing_but_the_new_tasks(store: Store) -> None:
    await add_node(store, "n1")
    await add_node(store, "n2")
    for storing in (False, True):  # the claim of tasks stored before it, and the claim that stores them
        assert await _claimed_locking(store, others=False, storing=storing) == (1, 1)
        assert await _claimed_locking(store, others=True, storing=storing) == (0, 0), (
            "another queued task: a pass that places it locks all at once")


async def _claimed_locking(store: Store, *, others: bool, storing: bool) -> tuple[int, int]:
    """A pass's claim (in a transaction rolled back after) given a new task foreseen on n1, with
    another task queued or not: how many nodes it says it locked, and how many of n1's locks another
    session finds held."""
    new = store.submissions([(TaskSpec(command=["true"]), None)], actor="op")
    async with store.pool.acquire() as c, store.pool.acquire() as other:
        tr = c.transaction()
        await tr.start()
        try:
            if others:
                await c.fetch(queries()["insert_tasks"], store.submissions([(TaskSpec(command=["true"]), None)], actor="op").rows,
                              "waiting", "op", False)  # fmt: skip
            if storing:
                rows = await c.fetch(queries()["insert_tasks_claiming"], 64, [], ["n1"], list(new.ids), new.rows, "waiting", "op")
            else:
                await c.fetch(queries()["insert_tasks"], new.rows, "waiting", "op", False)
                rows = await c.fetch(queries()["claim_queued"], 64, [], ["n1"], list(new.ids))
            assert new.ids[0] in [r["id"] for r in rows]
            free = await other.fetch("SELECT id FROM nodes WHERE id IN ('n1', 'n2') FOR NO KEY UPDATE SKIP LOCKED")
            return int(rows[0]["locked"]), 2 - len(free)
        finally:
            await tr.rollback()


async def test_a_pass_s_first_read_draws_as_many_fencing_tokens_as_it_is_asked_for_whatever_its_rows(store: Store) -> None:
    for i in range(5):
        await add_node(store, f"n{i}")
    q = queries()["dispatch_facts"]
    async with store.pool.acquire() as c:
        before = await c.fetchval("SELECT nextval('fencing_tokens')")
        rows = await c.fetch(q, 4096, None, 3)  # every node read: five rows
        after = await c.fetchval("SELECT nextval('fencing_tokens')")
        none = await c.fetch(q, 4096, None, 0)
    assert len(rows) == 5 and rows[0]["tokens"] == [before + 1, before + 2, before + 3]
    assert all(r["tokens"] is None for r in rows[1:]), "on the first row only"
    assert after == before + 4, "drawn once, not once a row"
    assert none[0]["tokens"] == []
