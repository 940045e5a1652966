"""Helpers for store tests: nodes registered and tasks placed through the real store statements."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import asyncpg

from podium import reasons
from podium.scheduler.service import Scheduler
from podium.spec import TaskSpec
from podium.states import AttemptState, TaskState
from podium.store import Change, Store, Subscription
from podium.store.db import DEFAULT_MAX_OPERATIONS
from podium.timing import DEFAULT_TIMING

WAIT = 30.0  # seconds a condition may take on a slow, busy machine
_T = TypeVar("_T")


class Statements(dict[str, str]):
    """A store's statements (`store.q = Statements(store.q, order)`), noting in `order` each one's
    name as it is taken to be run."""

    def __init__(self, q: dict[str, str], order: list[str]) -> None:
        super().__init__(q)
        self.order = order

    def __getitem__(self, name: str) -> str:
        self.order.append(name)
        return super().__getitem__(name)


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait for `cond` (checked every 10 ms), or fail saying what did not happen within WAIT."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {WAIT:.0f}s: {what}")
        await asyncio.sleep(0.01)


async def filled_under_a_pass(store: Store, db_url: str, nodes: list[str], run: Callable[[], Awaitable[_T]]) -> _T:
    """`run` (a dispatch pass) while another scheduler holds `nodes` and fills them: the pass places on
    what it read before that commits, and waits for the nodes' lock; what it returned. The wait is
    seen in this test's database only (the suite's other workers may share the server)."""
    other = await asyncpg.connect(db_url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT id FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR NO KEY UPDATE", nodes)
        await other.execute("UPDATE nodes SET res_slots = alloc_slots WHERE id = ANY($1::text[])", nodes)
        passing = asyncio.create_task(run())
        q = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        deadline = asyncio.get_running_loop().time() + WAIT
        while not await store.pool.fetchval(q):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not within {WAIT:.0f}s: the pass waiting for the nodes' lock")
            await asyncio.sleep(0.01)
        await tx.commit()
        return await passing
    finally:
        await other.close()


async def add_node(store: Store, node_id: str = "n1", *, slots: int = 4, cpu: int = 4000, memory: int = 8 * 2**30,
                   labels: dict[str, str] | None = None, max_operations: int | None = None) -> Any:  # fmt: skip
    # by default a node may prepare as many tasks at once as it has slots: only tests of the
    # operations limit (Capacity.Operations) set a lower one
    row = await store.node_hello(
        max_operations=max_operations or max(slots, DEFAULT_MAX_OPERATIONS),
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels=labels or {}, capabilities=[],
        backends=["process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=cpu,
        memory_bytes=memory, disk_bytes=10 * 2**30, gpus=0, slots=slots, gateway_id="test", agent_version="test",
    )  # fmt: skip
    assert row is not None
    return row


async def submit(store: Store, **spec: Any) -> uuid.UUID:
    spec.setdefault("command", ["true"])
    row, _ = await store.submit(TaskSpec(**spec))
    return row.id


def scheduler(store: Store) -> Scheduler:
    return Scheduler(store, DEFAULT_TIMING, server_id="test")


async def place(store: Store) -> Any:
    return await scheduler(store).dispatch_once()


async def tick(store: Store, sched: Any) -> Any:
    """One pass of `sched`, after which its horizon is no lower than a transaction id this test took
    just before the pass. A pass's own horizon is the xmin of its read's snapshot: on a PostgreSQL
    server shared with other tests, a transaction open in another database holds it back, and the
    next pass reads whole again (or a commit of ends will not place on) a node this test changed
    nothing of since. This test's database has no writer but the test itself, which had ended every
    earlier transaction of its own by then: the higher horizon misses nothing here, and which rows
    come whole no longer depends on the machine."""
    async with store.pool.acquire() as c:
        taken = await c.fetchval("SELECT pg_current_xact_id()")
    out = await sched.dispatch_once()
    d = sched.dispatcher
    assert d._horizon is not None
    d._horizon = max(d._horizon, taken)
    return out


async def node_row(store: Store, node_id: str) -> Any:
    async with store.pool.acquire() as c:
        return await c.fetchrow("SELECT * FROM nodes WHERE id = $1", node_id)


async def running_on(store: Store, node_id: str, n: int, **spec: Any) -> list[tuple[uuid.UUID, int]]:
    """`n` new tasks placed on the node `node_id` (the one placement picks: the caller sees to it)
    and taken through `provisioning` to `running` as that node would report them: (id, fencing
    token) each."""
    from podium.states import TaskState as S

    ids = [await submit(store, **spec) for _ in range(n)]
    await place(store)
    out = []
    for tid in ids:
        t = await store.get_task(tid)
        assert t.node_id == node_id and t.fencing_token is not None
        for a, b in ((S.ASSIGNED, S.PROVISIONING), (S.PROVISIONING, S.RUNNING)):
            assert await store.transition_task(tid, a, b, actor=f"node:{node_id}", fencing_token=t.fencing_token,
                                               node_id=node_id)  # fmt: skip
        out.append((tid, t.fencing_token))
    return out


async def running_on_n1(store: Store, **spec: Any) -> tuple[uuid.UUID, int]:
    """A task placed on a new node "n1" and taken through `provisioning` to `running` as that node
    would report them: its id and fencing token."""
    await add_node(store, "n1")
    [(tid, tok)] = await running_on(store, "n1", 1, **spec)
    return tid, tok


@contextlib.asynccontextmanager
async def looping(loop: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """One of the server's loops (a batcher's, the outbox's) running as a task for the block's length,
    cancelled and awaited after it."""
    task = asyncio.create_task(loop)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def to_running(store: Store, tid: uuid.UUID) -> tuple[str, int]:
    """An assigned task accepted and started by its node, as its reports would: (node, fencing token)."""
    t = await store.get_task(tid)
    assert t.node_id is not None and t.fencing_token is not None
    for a, b in ((TaskState.ASSIGNED, TaskState.PROVISIONING), (TaskState.PROVISIONING, TaskState.RUNNING)):
        assert await store.transition_task(tid, a, b, actor=f"node:{t.node_id}", fencing_token=t.fencing_token,
                                           node_id=t.node_id)  # fmt: skip
    return t.node_id, t.fencing_token


def ended(tid: uuid.UUID, node: str, tok: int, to: TaskState = TaskState.SUCCEEDED) -> Any:
    """A `decide` for `Store.transition_decided`: the running task's end as its node reports it,
    succeeded, or failed and (`to` queued) to be tried again."""

    def decide(rows: Any) -> list[Change]:
        assert rows[tid].state == TaskState.RUNNING
        ok = to == TaskState.SUCCEEDED
        return [Change(tid, TaskState.RUNNING, to, actor=f"node:{node}", fencing_token=tok, node_id=node, exit_code=0 if ok else 1,
                       end_attempt=AttemptState.EXITED if ok else AttemptState.FAILED,
                       reason=None if ok else reasons.RETRYABLE_ERROR)]  # fmt: skip

    return decide


async def heard(store: Store, sub: Subscription) -> list[str]:
    """The payloads of the `podium_dispatch` notifications committed since the last look (`sub` LISTENs
    on it): a marker is sent after them, and one channel's notifications arrive in commit order."""
    async with store.pool.acquire() as c:
        await c.execute("SELECT pg_notify('podium_dispatch', 'marker')")
    got: list[str] = []
    while not got or got[-1] != "marker":
        got.append((await asyncio.wait_for(sub.get(), WAIT)).payload)
    return got[:-1]
