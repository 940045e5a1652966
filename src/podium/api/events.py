"""The event stream: `GET /v1/events` (server-sent events of task and node changes) and the SSE log
follow `GET /v1/tasks/{id}/logs/stream`.

One `EventHub` per server holds one LISTEN connection (`podium_events`, sent by triggers on the event
tables) and one reader: on a NOTIFY it reads what is new once, keeps the latest events in memory and
wakes every client, which filters them itself. An idle client is a coroutine waiting on an asyncio
event, so a thousand of them cost the database nothing and the server almost nothing. A client behind
the hub's memory (one resuming from an old id) reads the database itself until it catches up.

Order and resumption: events are delivered in (txid, id) order, only once their transaction is below
the snapshot's xmin (see migration 0010); the SSE id is the event row's id, and `Last-Event-ID` (or
`?after=`) resumes after it: every missed event, in order, none twice, across server restarts.

Log followers (the SSE log follow here, the NDJSON `?follow=1` in routes/logs.py) are woken, not
polling: the hub's LISTEN connection also hears `podium_logs` (sent by the store's log insert, naming
the tasks given new chunks) and the hub wakes exactly the followers of those tasks, and of every task
whose event it reads (a state change, the end among them). A NOTIFY from any replica's gateway wakes
the followers here: NOTIFY is database-wide.

This module only reads: it must never change a task or a node.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from podium.api.models import ErrorOut
from podium.errors import InvalidRequest, StoreUnavailable
from podium.security.tokens import Role
from podium.states import TERMINAL, TaskState
from podium.store import Store, Subscription
from podium.store.rows import LogChunkRow, StreamEventRow, TaskRow
from podium.store.ui import Cursor, UiStore

log = logging.getLogger(__name__)

CHANNEL = "podium_events"
LOG_CHANNEL = "podium_logs"  # payload: ids of tasks given new log chunks, comma-separated
KEEPALIVE = 15.0  # seconds between keep-alive comments on an idle stream
SAFETY_POLL = 5.0  # the hub reads even without a NOTIFY this often (a lost listener, a missed wake)
# While committed events wait behind an older open transaction (in any database of the cluster: the
# horizon is the cluster's), look again after HELD_POLL, backing off to HELD_POLL_MAX.
HELD_POLL = 0.05
HELD_POLL_MAX = 1.0
BUFFER = 20_000  # events the hub keeps for clients that fall a little behind
# A read that found at least BUSY_READ events (the fleet is busy: commits come faster than reads) is
# followed by a pause of COALESCE before the next read, so that one read takes what several commits
# wrote: a read has a price of its own (its snapshot, its plan, its round trip, a wake of every
# client), which at one read per commit of a busy server was a tenth of the database's CPU and more of
# the server's. A read that found little (one task at a time, an idle fleet) is followed by none:
# there, the next event is read as soon as its NOTIFY comes.
BUSY_READ = 16
COALESCE = 0.01  # seconds
PAGE = 1000
START_WAIT = 10.0  # seconds a new client waits for the hub's first read before a 503
# A log follower reads again after this long even without a wake: a NOTIFY sent while the hub's
# listener was reconnecting is lost (the reconnect wakes every follower, but a chunk can commit in
# between). PODIUM_TEST_LOG_BACKSTOP sets it, so a test can show that the wake alone delivers.
LOG_BACKSTOP = 5.0
LOG_BACKSTOP_ENV = "PODIUM_TEST_LOG_BACKSTOP"

_ERRORS: dict[int | str, dict[str, Any]] = {c: {"model": ErrorOut} for c in (401, 403, 404, 422, 503)}


def _key(c: Cursor) -> tuple[int, int]:
    return (c.txid, c.id)


def cursor_of_row(r: StreamEventRow, floor: int = 0) -> Cursor:
    return Cursor(int(r.txid), int(r.id), floor)


def _log_backstop() -> float:
    raw = os.environ.get(LOG_BACKSTOP_ENV, "")
    if not raw:
        return LOG_BACKSTOP
    try:
        value = float(raw)
        if not value > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{LOG_BACKSTOP_ENV}={raw!r} is not a number of seconds above 0; unset it for {LOG_BACKSTOP}") from None
    return value


class Wake:
    """What one log follower waits on: set when its task may have new output or a new state."""

    def __init__(self, backstop: float) -> None:
        self._event = asyncio.Event()
        self.backstop = backstop

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Until woken (True), or `timeout` (the backstop when None) has passed (False). Cleared on
        return, before the caller reads: a chunk stored after that read's snapshot sets it again, so
        no wake falls between a read and the next wait."""
        if not self._event.is_set():  # (a wait with no time left gives up before looking)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a wait that
            # ended in the same turn as a cancel of its caller, and the cancel is lost
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.backstop if timeout is None else max(0.0, timeout)):
                    await self._event.wait()
        # a wake at the very moment the time ran out still counts
        woke = self._event.is_set()
        self._event.clear()
        return woke


class EventHub:
    def __init__(self, store: Store, ui: UiStore, *, reads: UiStore | None = None) -> None:
        """`ui` serves the streams that are behind the hub's memory (many at once); `reads`, when given,
        the hub's one reader (one statement, run after every commit that writes events)."""
        self.store = store
        self.ui = ui
        self.reads = reads or ui
        self.start: Cursor | None = None  # the buffer holds every event after this
        self.head: Cursor | None = None  # the last event read
        self._keys: list[tuple[int, int]] = []
        self._rows: list[Any] = []
        self._changed = asyncio.Event()  # replaced at every change; clients wait on the current one
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self.closed = False
        self.clients = 0
        self._held_delay = HELD_POLL
        self._busy = False  # the last read found BUSY_READ events or more: the next one waits COALESCE
        self.pauses = 0  # reads that waited COALESCE
        # task id (as PostgreSQL prints it, the NOTIFY's form) -> the wakes of its log followers
        self._followers: dict[str, set[Wake]] = {}
        self.log_backstop = _log_backstop()

    # ---- the one reader ------------------------------------------------------------------------

    async def ensure_started(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="events.hub")
        try:
            async with asyncio.timeout(START_WAIT):  # (not wait_for: see Wake.wait)
                await asyncio.shield(self._started.wait())
        except TimeoutError:
            raise StoreUnavailable("the event stream cannot reach PostgreSQL yet") from None

    def close(self) -> None:
        """End every stream (the server is stopping) and the reader."""
        self.closed = True
        self._changed.set()
        self._wake_followers(None)
        if self._task is not None:
            self._task.cancel()

    def _notify(self, _payload: str) -> None:
        self._wake.set()

    def _logs_written(self, payload: str) -> None:
        if self._followers:
            self._wake_followers(payload.split(","))

    def _wake_followers(self, task_ids: list[str] | None) -> None:
        """Wake the followers of these tasks (None: of every task)."""
        if task_ids is None:
            for wakes in self._followers.values():
                for w in wakes:
                    w.set()
            return
        for tid in task_ids:
            for w in self._followers.get(tid, ()):
                w.set()

    @contextlib.contextmanager
    def log_follower(self, task_id: uuid.UUID) -> Iterator[Wake]:
        """A wake for one follower of `task_id`'s output, set by every chunk stored for the task and
        every event of it the hub reads, on any replica, for as long as the `with` lasts."""
        key = str(task_id)
        wake = Wake(self.log_backstop)
        wakes = self._followers.setdefault(key, set())
        wakes.add(wake)
        try:
            yield wake
        finally:
            wakes.discard(wake)
            if not wakes:
                self._followers.pop(key, None)

    async def _run(self) -> None:
        conn: Subscription | None = None
        try:
            while not self.closed:
                try:
                    if conn is None or conn.is_closed():
                        conn = await self.store.listen(CHANNEL, self._notify, also={LOG_CHANNEL: self._logs_written})
                        # NOTIFYs sent while no one listened are gone: read now, and so do followers
                        self._wake.set()
                        self._wake_followers(None)
                    if self.start is None:
                        self.start = self.head = await self.reads.start_cursor()
                        self._started.set()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(SAFETY_POLL):  # (not wait_for: see Wake.wait)
                            await self._wake.wait()
                    if self._busy:
                        self.pauses += 1
                        await asyncio.sleep(COALESCE)
                    self._wake.clear()
                    await self._read()
                except Exception as e:  # noqa: BLE001 - the one reader must outlive any single failure
                    log.warning("event stream: %s; retrying", e)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                    await asyncio.sleep(1.0)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _read(self) -> None:
        assert self.head is not None
        got = 0
        while True:
            # the rows and whether more are held back behind an open transaction, in one round trip
            rows, held = await self.reads.hub_read(self.head, PAGE)
            for r in rows:
                c = cursor_of_row(r)
                self._keys.append(_key(c))
                self._rows.append(r)
                self.head = c
            if self._followers:
                self._wake_followers([str(r.task_id) for r in rows if r.kind == "task"])
            got += len(rows)
            if len(rows) < PAGE:
                break
        if got:  # (a read that found nothing, after a wake that brought nothing yet, says nothing of the load)
            self._busy = got >= BUSY_READ
        if len(self._rows) > BUFFER:
            drop = len(self._rows) - BUFFER
            self.start = cursor_of_row(self._rows[drop - 1])
            del self._rows[:drop], self._keys[:drop]
        if got:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
        if held:
            asyncio.get_running_loop().call_later(self._held_delay, self._wake.set)
            self._held_delay = min(HELD_POLL_MAX, self._held_delay * 2)
        else:
            self._held_delay = HELD_POLL

    # ---- clients -------------------------------------------------------------------------------

    def covers(self, c: Cursor) -> bool:
        return self.start is not None and _key(c) >= _key(self.start)

    def after(self, c: Cursor) -> list[Any]:
        return self._rows[bisect.bisect_right(self._keys, _key(c)) :]

    async def follow(
        self, cursor: Cursor | None, match: Callable[[Any], bool], db_filters: dict[str, Any]
    ) -> AsyncIterator[Any | None]:
        """Events after `cursor` (None: from now on) that `match`, forever; None is a keep-alive."""
        async for batch in self.follow_batches(cursor, match, db_filters):
            if batch is None:
                yield None
            for r in batch or ():
                yield r

    async def follow_batches(
        self, cursor: Cursor | None, match: Callable[[Any], bool], db_filters: dict[str, Any]
    ) -> AsyncIterator[list[Any] | None]:
        """`follow`'s events in the batches they become known in (what one read of the hub's memory or
        of the database found, PAGE at most), never an empty one: a stream writes each batch at once.
        One write per event cost a busy server more than the events themselves (every write goes
        through the ASGI stack and the HTTP connection's state machine)."""
        await self.ensure_started()
        assert self.head is not None
        if cursor is None:
            cursor = self.head
        self.clients += 1
        try:
            while not self.closed:
                if self.covers(cursor):
                    changed = self._changed
                    rows = self.after(cursor)
                    if rows:
                        cursor = cursor_of_row(rows[-1], cursor.floor)
                        floor = cursor.floor
                        batch = [r for r in rows if r.id > floor and match(r)]
                        for i in range(0, len(batch), PAGE):
                            yield batch[i : i + PAGE]
                        continue
                    try:
                        # not wait_for: a stream cancelled (its client gone) in the turn its wake came
                        # went on waiting, its cancel lost (Python 3.11's wait_for; see Wake.wait)
                        async with asyncio.timeout(KEEPALIVE):
                            await changed.wait()
                    except TimeoutError:
                        yield None
                    continue
                # behind the hub's memory: read the database until caught up
                start_before = self.start
                rows = await self.ui.events_after(cursor, PAGE, **db_filters)
                if rows:
                    cursor = cursor_of_row(rows[-1], cursor.floor)
                    yield rows
                if len(rows) < PAGE and start_before is not None and _key(start_before) > _key(cursor):
                    # that read saw every event up to where the hub's memory begins (its horizon
                    # was later than the one the hub began at): continue from the hub
                    cursor = Cursor(start_before.txid, start_before.id, cursor.floor)
                elif len(rows) < PAGE:
                    await asyncio.sleep(0.05)
        finally:
            self.clients -= 1


def event_json(r: StreamEventRow) -> dict[str, Any]:
    if r.kind == "task":
        return {
            "id": r.id, "kind": "task", "at": r.at.isoformat(), "task_id": str(r.task_id),
            "task_name": r.task_name, "from_state": r.from_state, "state": r.state, "reason": r.reason,
            "actor": r.actor, "attempt": r.attempt, "node_id": r.node_id, "fencing_token": r.fencing_token,
        }  # fmt: skip
    return {
        "id": r.id, "kind": "node", "at": r.at.isoformat(), "node_id": r.node_id, "health": r.health,
        "connected": r.connected, "draining": r.draining, "revoked": r.revoked, "labels": r.labels,
    }  # fmt: skip


def sse(event: str, data: str, event_id: int | None = None) -> bytes:
    """One server-sent event; every line of `data` becomes its own `data:` line."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"{head}event: {event}\n{body}\n".encode()


KEEPALIVE_BYTES = b": keep-alive\n\n"


class Filters:
    """A stream's filters, checked in memory on the hub's events and in SQL on a catch-up read."""

    def __init__(self, task_id: uuid.UUID | None, node_id: str | None, states: frozenset[str] | None, kinds: set[str]) -> None:
        self.task_id, self.node_id, self.states, self.kinds = task_id, node_id, states, kinds

    def match(self, r: StreamEventRow) -> bool:
        if r.kind not in self.kinds:
            return False
        if r.kind == "node":
            return self.task_id is None and self.states is None and (self.node_id is None or r.node_id == self.node_id)
        return (
            (self.task_id is None or r.task_id == self.task_id)
            and (self.node_id is None or r.node_id == self.node_id)
            and (self.states is None or r.state in self.states)
        )

    def db(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "node_id": self.node_id, "states": None if self.states is None else sorted(self.states),
                "tasks": "task" in self.kinds, "nodes": "node" in self.kinds}  # fmt: skip


async def parse_filters(
    store: Store, task: str | None, node: str | None, state: str | None, kind: str | None
) -> Filters:
    task_id = None
    if task:
        try:
            task_id = uuid.UUID(task)
        except ValueError:
            raise InvalidRequest(f"task: {task!r} is not a task id; task ids are UUIDs like 3f2a…") from None
    states = parse_states(state) if state else None
    node_id = (await store.get_node(node)).id if node else None
    if kind not in (None, "", "task", "node"):
        raise InvalidRequest(f"kind: {kind!r} is neither 'task' nor 'node'; leave it out for both")
    return Filters(task_id, node_id, states, {kind} if kind else {"task", "node"})


def parse_states(raw: str) -> frozenset[str]:
    """`running` or `running,succeeded,failed`: the task states a stream is limited to."""
    states = set()
    for name in raw.split(","):
        name = name.strip()
        if not name:
            raise InvalidRequest(f"state: {raw!r} has an empty name; separate task states with single commas, as in running,succeeded")
        try:
            states.add(TaskState(name).value)
        except ValueError:
            raise InvalidRequest(f"state: {name!r} is not a task state; one of {', '.join(s.value for s in TaskState)}") from None
    return frozenset(states)


async def resume_cursor(ui: UiStore, last_event_id: str | None, after: int | None) -> Cursor | None:
    raw = after if after is not None else last_event_id
    if raw is None or raw == "":
        return None
    try:
        event_id = int(raw)
        if event_id < 0:
            raise ValueError
    except ValueError:
        raise InvalidRequest(f"Last-Event-ID: {raw!r} is not an event id (a whole number this stream sent)") from None
    return await ui.cursor_of(event_id)


def event_stream(hub: EventHub, cursor: Cursor | None, filters: Filters, render: Callable[[Any], bytes]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        yield b"retry: 1000\n\n"
        async for batch in hub.follow_batches(cursor, filters.match, filters.db()):
            yield KEEPALIVE_BYTES if batch is None else b"".join(map(render, batch))

    return gen()


def _json_event(r: StreamEventRow) -> bytes:
    # A stream's JSON was two thirds of its cost on a busy server: orjson, and no line splitting (its
    # output is one line: a newline inside a string is escaped)
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (r.id, r.kind.encode(), orjson.dumps(event_json(r)))


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def log_stream(store: Store, hub: EventHub, task_id: uuid.UUID, after: int, render: Callable[[Any], bytes],
                     end: Callable[[Any], bytes]) -> AsyncIterator[bytes]:  # fmt: skip
    """Log chunks of a task as SSE, in the order they were written, then one end event once the task
    has ended and a read after that found nothing new. Each event's id is its chunk's id, so
    Last-Event-ID resumes; the read itself goes by position (fencing token, seq, stream), never by
    id: ids are handed out in whatever order an insert's plan produces, not in the order written.
    Between reads it waits for the hub's wake (a chunk stored, an event of the task), not a timer."""
    yield b"retry: 1000\n\n"
    position: tuple[int, int, str] | None = None
    if after:
        try:
            position = await store.log_position(task_id, after)
        except StoreUnavailable:
            position = None
        if position is None:
            yield sse("error", json.dumps({"error": f"chunk {after} is no chunk of this task; resume with an id this stream sent"}), None)
            return
    # the hub's LISTEN must be up before the first read, or a chunk stored between the two wakes no
    # one; a hub that cannot start yet leaves this follower to its backstop reads
    with contextlib.suppress(StoreUnavailable):
        await hub.ensure_started()
    clock = asyncio.get_running_loop().time
    with hub.log_follower(task_id) as wake:
        quiet_since = clock()
        while not hub.closed:
            try:
                # the task first, its output second: the gateway stores an attempt's output before
                # its end, so a task already ended here has all of it stored before the read below
                task = await store.get_task(task_id)
                rows = await store.read_logs(task_id, after=position, limit=1000)
            except StoreUnavailable:
                await asyncio.sleep(1)
                continue
            for r in rows:
                position = (r.fencing_token, r.seq, r.stream)
                yield render(r)
            if rows:
                quiet_since = clock()
                continue
            if TaskState(task.state) in TERMINAL:
                yield end(task)
                return
            # keep-alives while waiting do not read: only a wake or the backstop does
            backstop = clock() + wake.backstop
            while not await wake.wait(min(backstop, quiet_since + KEEPALIVE) - clock()) and clock() < backstop:
                quiet_since = clock()
                yield KEEPALIVE_BYTES


def router() -> APIRouter:
    r = APIRouter()

    @r.get(
        "/v1/events",
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
        response_class=StreamingResponse,
    )
    async def events(
        request: Request,
        task: Annotated[str | None, Query(max_length=64, description="only this task's events")] = None,
        node: Annotated[str | None, Query(max_length=128, description="only events on this node (id or name)")] = None,
        state: Annotated[str | None, Query(max_length=256, description="only task events into this state, or into any of "
                                           "several separated by commas (running,succeeded,failed)")] = None,
        kind: Annotated[str | None, Query(max_length=8, description="'task' or 'node'; both when left out")] = None,
        after: Annotated[int | None, Query(ge=0, description="resume after this event id (as Last-Event-ID)")] = None,
        last_event_id: Annotated[str | None, Header(max_length=32)] = None,
    ) -> StreamingResponse:
        """Server-sent events of task changes (state, reason, attempt, node) and node changes (health,
        connected, drain, labels). Each event's id is its row's id; reconnecting with `Last-Event-ID`
        (or `?after=`) gets every event missed, in order, none twice."""
        app = request.app
        await app.state.sessions.caller(request, Role.VIEWER)
        store: Store = app.state.store
        filters = await parse_filters(store, task, node, state, kind)
        cursor = await resume_cursor(app.state.ui_store, last_event_id, after)
        return StreamingResponse(
            event_stream(app.state.event_hub, cursor, filters, _json_event), media_type="text/event-stream", headers=SSE_HEADERS
        )

    @r.get(
        "/v1/tasks/{task_id}/logs/stream",
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
        response_class=StreamingResponse,
    )
    async def log_events(
        request: Request,
        task_id: str,
        after: Annotated[int | None, Query(ge=0, description="resume after this chunk id")] = None,
        encoding: Annotated[Literal["utf-8", "base64"], Query(description="how `data` carries the bytes (base64: exactly)")] = "utf-8",
        last_event_id: Annotated[str | None, Header(max_length=32)] = None,
    ) -> StreamingResponse:
        """A task's output as server-sent events (`chunk`, id = the chunk id) until it ends (`end`:
        state, exit code, reason). Resumable with `Last-Event-ID` or `?after=`: every chunk after
        that one, in the order written, none twice, across server restarts. With `encoding=base64`
        each chunk's `data` is its bytes exactly (`podium run` and the client read it so)."""
        app = request.app
        await app.state.sessions.caller(request, Role.VIEWER)
        tid = _task_id(task_id)
        store: Store = app.state.store
        await store.get_task(tid)
        start = _after(last_event_id, after)
        hub: EventHub = app.state.event_hub
        await hub.ensure_started()  # here, so a database not reachable yet is a 503, not a cut stream

        def chunk(row: LogChunkRow) -> bytes:
            raw = bytes(row.data)
            text = base64.b64encode(raw).decode() if encoding == "base64" else raw.decode("utf-8", errors="replace")
            data = {"id": row.id, "attempt": row.attempt, "stream": row.stream, "data": text}
            return sse("chunk", json.dumps(data), row.id)

        def end(task: TaskRow) -> bytes:
            return sse("end", json.dumps({"state": task.state, "exit_code": task.exit_code, "reason": task.reason}))

        return StreamingResponse(
            log_stream(store, hub, tid, start, chunk, end), media_type="text/event-stream", headers=SSE_HEADERS
        )

    return r


def _task_id(task_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(task_id)
    except ValueError:
        raise InvalidRequest(f"{task_id!r} is not a task id; task ids are UUIDs like 3f2a…") from None


def _after(last_event_id: str | None, after: int | None) -> int:
    raw: Any = after if after is not None else last_event_id
    if raw in (None, ""):
        return 0
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise InvalidRequest(f"Last-Event-ID: {raw!r} is not a chunk id (a whole number this stream sent)") from None


