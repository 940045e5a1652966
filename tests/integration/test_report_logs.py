"""An attempt's output and its end: the chunks a node sent before an end are committed in the
transaction that records the end (`LogFlusher.taken` inside the report batcher's group commit) —
never after it, and never lost when that transaction cannot be made. Real PostgreSQL; the gateway's
own batcher and log flusher; a stream stood in for by the gateway's `Session` (what it would write to
the node is read from its queue). And the node of an end is locked only to write the end: a dispatch
pass waiting for the node's lock does not wait for the group commit's read and decisions."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from podium.errors import StoreUnavailable
from podium.gateway.liveness import LogFlusher
from podium.gateway.reports import ReportBatcher
from podium.gateway.sessions import Session, Sessions
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.states import TaskState as S
from podium.store import Change, Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import WAIT, Statements, add_node, place, running_on, running_on_n1, scheduler, submit

K = pb.TaskEvent.Kind


async def _eventually(cond: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if v := await cond():
            return v
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.asynccontextmanager
async def batching(store: Store) -> AsyncIterator[tuple[ReportBatcher, LogFlusher, Session]]:
    """The report batcher's group commit running, with its log flusher (whose own timer does not
    run: only the batcher stores chunks here), for one node "n1" whose stream is `Session`."""
    sessions = Sessions()
    s = Session("n1", 1)
    sessions["n1"] = s
    logs = LogFlusher(store, sessions)
    batcher = ReportBatcher(store, sessions, DEFAULT_TIMING, logs=logs)
    loop = asyncio.create_task(batcher.loop())
    try:
        yield batcher, logs, s
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


def said(s: Session) -> list[Any]:
    out = []
    while not s.out.empty():
        m = s.out.get_nowait()
        if m is not None:
            out.append(getattr(m, m.WhichOneof("kind")))
    return out


async def stored(store: Store, tid: uuid.UUID) -> list[bytes]:
    async with store.pool.acquire() as c:
        return [bytes(r["data"]) for r in await c.fetch("SELECT data FROM log_chunks WHERE task_id = $1 ORDER BY seq", tid)]


def end(tid: uuid.UUID, token: int, exit_code: int = 0) -> pb.TaskEvent:
    return pb.TaskEvent(task_id=str(tid), fencing_token=token, kind=K.EXITED, exit_code=exit_code)


async def test_the_output_before_an_end_is_committed_with_it_and_acknowledged(store: Store) -> None:
    tid, tok = await running_on_n1(store, command=["echo", "hi"])
    heard: list[Any] = []
    async with batching(store) as (batcher, logs, s):
        logs.add("n1", (tid, tok, "stdout", 0, 0, b"hi\n"))
        logs.add("n1", (tid, tok, "stderr", 1, 0, b"warn\n"))
        await batcher.enqueue(s, end(tid, tok))

        async def acked() -> bool:
            heard.extend(said(s))
            return any(isinstance(m, pb.Ack) for m in heard)

        await _eventually(acked, "the end acknowledged")
    assert (await store.get_task(tid)).state == S.SUCCEEDED
    assert await stored(store, tid) == [b"hi\n", b"warn\n"]
    assert {(m.stream, m.seq) for m in heard if isinstance(m, pb.LogAck)} == {("stdout", 0), ("stderr", 1)}


@pytest.mark.parametrize(("exit_code", "made_by"), [(1, "transition_decided"), (0, "end_expected")], ids=["read", "expected"])
async def test_output_whose_end_could_not_be_committed_is_kept_and_stored_with_it_later(
    store: Store, exit_code: int, made_by: str
) -> None:
    # an end that failed is decided on its task's row as read, in a group commit; a lone success is
    # made as its row is expected to be, in one statement (`end_expected`): the output rides with either
    tid, tok = await running_on_n1(store, command=["echo", "hi"])
    made = getattr(store, made_by)
    heard_before_retry: list[Any] = []
    tries = 0
    async with batching(store) as (batcher, logs, s):

        async def down_once(*args: Any, **kwargs: Any) -> Any:
            nonlocal tries
            tries += 1
            assert kwargs.get("logs") == [(tid, tok, "stdout", 0, 0, b"hi\n", "n1")], "the chunk rides with its end"
            if tries == 1:
                raise StoreUnavailable("connection reset (a test's)")
            heard_before_retry.extend(said(s))
            return await made(*args, **kwargs)

        setattr(store, made_by, down_once)
        try:
            logs.add("n1", (tid, tok, "stdout", 0, 0, b"hi\n"))
            await batcher.enqueue(s, end(tid, tok, exit_code=exit_code))
            ended = S.FAILED if exit_code else S.SUCCEEDED
            await _eventually(lambda: state_is(store, tid, ended), "the end recorded on the retry")
        finally:
            delattr(store, made_by)
        heard = said(s)
    # not stored the first time, so not acknowledged then (the node keeps it, to send again)
    assert tries == 2 and not heard_before_retry
    assert await stored(store, tid) == [b"hi\n"]
    assert [(m.stream, m.seq) for m in heard if isinstance(m, pb.LogAck)] == [("stdout", 0)]


async def state_is(store: Store, tid: uuid.UUID, state: S) -> bool:
    return (await store.get_task(tid)).state == state


async def test_a_group_commit_decides_an_end_without_waiting_for_its_nodes_lock(store: Store) -> None:
    """Another transaction (a dispatch pass placing on "n1") holds the node's row: the batch reads and
    decides the end all the same, and writes it once the node is free. Taken with the read, the
    node's lock was held through the read and the decisions, and placements on it waited for them."""
    tid, tok = await running_on_n1(store)
    async with store.pool.acquire() as holder, batching(store) as (batcher, _logs, s):
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT id FROM nodes WHERE id = 'n1' FOR NO KEY UPDATE")
        decided = asyncio.Event()
        decide = batcher._decide

        def deciding(batch: Any, rows: Any) -> Any:
            decided.set()
            return decide(batch, rows)

        batcher._decide = deciding  # type: ignore[method-assign]
        await batcher.enqueue(s, end(tid, tok, exit_code=1))  # (decided on a read: a success is not, below)
        await asyncio.wait_for(decided.wait(), 30)  # while the node is still held
        assert (await store.get_task(tid)).state == S.RUNNING  # its end waits for the node
        await tx.rollback()
        await _eventually(lambda: state_is(store, tid, S.FAILED), "the end recorded once the node is free")


# --- a lone success, made as its row is expected to be ----------------------------------------------


async def test_a_lone_success_and_its_output_are_one_statement_committed_on_its_own(store: Store) -> None:
    """A command run one at a time on an idle fleet: its `running` and its end (exit 0) come in one
    batch, and are made on what the task's row is expected to hold, with the output sent before them,
    in one statement — no read under locks, no BEGIN or COMMIT of their own. The task, its attempt,
    its events and its output are what a group commit leaves."""
    tid, tok = await running_on_n1(store, command=["echo", "hi"])
    other, other_tok = await running_on_n1_again(store)
    statements: list[str] = []
    async with batching(store) as (batcher, logs, s):
        q, store.q = store.q, Statements(store.q, statements)
        logs.add("n1", (tid, tok, "stdout", 0, 0, b"hi\n"))
        await batcher.enqueue(s, end(tid, tok))
        await _eventually(lambda: state_is(store, tid, S.SUCCEEDED), "the end recorded")
        # (`get_task`: this test's own reads, waiting for the state)
        assert [q for q in statements if q != "get_task"] == ["transition_tasks_storing_logs"], statements
        store.q = q
        # the control: the same end of another task, decided on a read (exit 1 is not made as expected)
        logs.add("n1", (other, other_tok, "stdout", 0, 0, b"hi\n"))
        await batcher.enqueue(s, end(other, other_tok, exit_code=1))
        await _eventually(lambda: state_is(store, other, S.FAILED), "the other end recorded")
        heard = said(s)
    assert await stored(store, tid) == [b"hi\n"]
    assert [m.task_id for m in heard if isinstance(m, pb.Ack)] == [str(tid), str(other)]
    t = await store.get_task(tid)
    assert (t.exit_code, t.node_id, t.lease_expires_at, t.finished_at is not None) == (0, None, None, True)
    _t, attempts, events = await store.task_detail(tid)
    assert [(a.state, a.exit_code, a.finished_at is not None) for a in attempts] == [("exited", 0, True)]
    assert [(e.from_state, e.to_state, e.actor) for e in events][-1] == ("running", "succeeded", "node:n1")
    async with store.pool.acquire() as c:
        room = await c.fetchrow("SELECT res_slots, res_cpu_millis FROM nodes WHERE id = 'n1'")
    assert tuple(room) == (0, 0), "both attempts' capacity freed"


async def test_a_lone_success_whose_task_was_cancelled_meanwhile_is_decided_on_a_read(store: Store) -> None:
    tid, tok = await running_on_n1(store)
    async with batching(store) as (batcher, logs, s):
        assert (await scheduler(store).cancel(tid, "op")).state == S.CANCELLING
        logs.add("n1", (tid, tok, "stdout", 0, 0, b"late\n"))
        made = store.end_expected
        refused: list[Any] = []

        async def noted(change: Any, **kw: Any) -> Any:
            r = await made(change, **kw)
            refused.append(r)
            return r

        store.end_expected = noted  # type: ignore[method-assign]
        await batcher.enqueue(s, end(tid, tok))
        await _eventually(lambda: state_is(store, tid, S.CANCELLED), "the cancel's end recorded")
        heard = said(s)
    assert refused == [None], "the row was not as expected: nothing made, decided on a read"
    assert await stored(store, tid) == [b"late\n"], "stored by the statement its row refused"
    assert [m.task_id for m in heard if isinstance(m, pb.Ack)] == [str(tid)]


async def running_on_n1_again(store: Store) -> tuple[uuid.UUID, int]:
    """Another task running on "n1" (made by `running_on_n1`)."""
    [(tid, tok)] = await running_on(store, "n1", 1)
    return tid, tok



async def test_a_group_commit_storing_output_never_waits_for_a_pass_that_claimed_that_outputs_task(store: Store) -> None:
    """The output a group commit stores with its read may be another task's: one queued again after
    its node was lost, whose node sends its unacknowledged chunks once more. A pass may hold that task,
    claimed, while it waits for a node the group commit holds. The chunk's foreign key check (a share
    of its task's key, taken at the statement's end, after the commit's tasks and nodes are locked)
    does not wait for the claim (`FOR NO KEY UPDATE`): claimed `FOR UPDATE`, the two waited for each
    other until PostgreSQL's deadlock_timeout broke one."""
    await add_node(store, "nB", slots=1)
    [(x, _xtok)] = await running_on(store, "nB", 1)
    await add_node(store, "nA", slots=1)
    q = await submit(store)
    [(placed, node, qtok)] = (await place(store)).assigned
    assert (placed, node) == (q, "nA")
    lost = Change(q, S.ASSIGNED, S.QUEUED, actor="test", reason="node lost", fencing_token=qtok, node_id="nA",
                  end_attempt="lost")  # fmt: skip
    assert await store.transition(lost) is not None
    async with store.pool.acquire() as d, store.pool.acquire() as g:
        pass_tx = d.transaction()
        await pass_tx.start()
        assert q in [r["id"] for r in await d.fetch(store.q["claim_queued"], 10, [], [], [])]
        commit_tx = g.transaction()
        await commit_tx.start()
        rows = await asyncio.wait_for(
            g.fetch(store.q["lock_task_facts_storing_logs"], [x], [x], [q], [qtok], ["stdout"], [0], [0], [b"x"], ["nA"]),
            WAIT,  # not the claim's whole length: it is held until this test lets it go
        )
        assert [r["id"] for r in rows] == [x]
        # the pass then waits for the node the group commit holds, and has it once that commits
        locking = asyncio.ensure_future(d.execute(store.q["lock_nodes"], ["nB"]))
        await asyncio.sleep(0.1)
        assert not locking.done()
        await commit_tx.commit()
        await asyncio.wait_for(locking, WAIT)
        await pass_tx.rollback()
    assert await stored(store, q) == [b"x"]
