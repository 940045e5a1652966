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

from podium.errors import StoreUnavailable
from podium.gateway.liveness import LogFlusher
from podium.gateway.reports import ReportBatcher
from podium.gateway.sessions import Session, Sessions
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.states import TaskState as S
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import running_on_n1

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


def end(tid: uuid.UUID, token: int) -> pb.TaskEvent:
    return pb.TaskEvent(task_id=str(tid), fencing_token=token, kind=K.EXITED, exit_code=0)


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


async def test_output_whose_end_could_not_be_committed_is_kept_and_stored_with_it_later(store: Store) -> None:
    tid, tok = await running_on_n1(store, command=["echo", "hi"])
    made = store.transition_decided
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

        store.transition_decided = down_once  # type: ignore[method-assign]
        try:
            logs.add("n1", (tid, tok, "stdout", 0, 0, b"hi\n"))
            await batcher.enqueue(s, end(tid, tok))
            await _eventually(lambda: state_is(store, tid, S.SUCCEEDED), "the end recorded on the retry")
        finally:
            del store.transition_decided
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
        await batcher.enqueue(s, end(tid, tok))
        await asyncio.wait_for(decided.wait(), 30)  # while the node is still held
        assert (await store.get_task(tid)).state == S.RUNNING  # its end waits for the node
        await tx.rollback()
        await _eventually(lambda: state_is(store, tid, S.SUCCEEDED), "the end recorded once the node is free")
