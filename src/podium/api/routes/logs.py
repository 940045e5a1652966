"""A task's output: `GET /v1/tasks/{id}/logs`, a page at a time or followed (NDJSON) until the task
ends. Reads go by position (fencing token, seq, stream), so a reader resuming from a cursor gets
every byte after it, in order, none twice. A follower reads again when the event hub wakes it (a
chunk of the task stored, an event of it), never on a timer of its own. This router only reads."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from podium.api.deps import EventHubDep, StoreDep, Viewer, task_ref
from podium.api.events import EventHub
from podium.api.models import LogChunkOut, LogsOut
from podium.api.paging import ERRORS
from podium.errors import InvalidRequest, StoreUnavailable
from podium.states import TERMINAL, TaskState
from podium.store import Store
from podium.store.rows import LogChunkRow

router = APIRouter()

BIGINT_MAX = 2**63 - 1
_CURSOR = re.compile(r"^(\d{1,19})\.(\d{1,19})\.(stdout|stderr)$")


def _log_cursor(position: tuple[int, int, str]) -> str:
    return "{}.{}.{}".format(*position)


def _parse_log_cursor(text: str) -> tuple[int, int, str]:
    m = _CURSOR.match(text)
    if m is None or int(m[1]) > BIGINT_MAX or int(m[2]) > BIGINT_MAX:
        raise InvalidRequest(f"cursor {text!r} is not one this server gave; use a chunk's cursor or next_cursor as returned")
    return int(m[1]), int(m[2]), m[3]


class _LogRead:
    """One reader's place in a task's output: the position of the last chunk it was given, and its
    filters. Reading moves the position on, so a follower never sees a chunk twice."""

    def __init__(self, tid: uuid.UUID, position: tuple[int, int, str] | None, stream: str | None,
                 attempt: int | None, offset: int, encoding: str) -> None:  # fmt: skip
        self.tid = tid
        self.position = position
        self.stream = stream
        self.attempt = attempt
        self.offset = offset
        self.encoding = encoding

    async def page(self, store: Store, limit: int) -> list[LogChunkRow]:
        rows = await store.read_logs(self.tid, after=self.position, stream=self.stream, attempt=self.attempt,
                                     offset=self.offset, limit=limit)  # fmt: skip
        if rows:
            last = rows[-1]
            self.position = (last.fencing_token, last.seq, last.stream)
        return rows

    def chunk(self, r: LogChunkRow) -> LogChunkOut:
        data, offset = bytes(r.data), r.byte_offset
        if offset < self.offset:  # the chunk holding the byte asked for: from that byte on
            data, offset = data[self.offset - offset :], self.offset
        return LogChunkOut(
            id=r.id, attempt=r.attempt, fencing_token=r.fencing_token, stream=r.stream, seq=r.seq,
            offset=offset, length=len(data), cursor=_log_cursor((r.fencing_token, r.seq, r.stream)),
            data=base64.b64encode(data).decode() if self.encoding == "base64" else data.decode("utf-8", errors="replace"),
        )  # fmt: skip


async def _follow(store: Store, hub: EventHub, read: _LogRead) -> AsyncIterator[bytes]:
    """NDJSON: {"chunk": …} lines as output arrives, then one {"end": {state, exit_code, reason}}.
    The end is sent only after a read following the terminal state found nothing new, so no output
    written before the end is missed. A stream the server ends without an end line (it is stopping)
    is resumed from the last chunk's cursor."""
    with hub.log_follower(read.tid) as wake:
        while not hub.closed:
            try:
                # the task first, its output second: the gateway stores an attempt's output before
                # its end, so a task already ended here has all of it stored before the read below
                task = await store.get_task(read.tid)
                rows = await read.page(store, 1000)
            except StoreUnavailable:
                await asyncio.sleep(1)
                continue
            for r in rows:
                yield (json.dumps({"chunk": read.chunk(r).model_dump()}) + "\n").encode()
            if rows:
                continue
            if TaskState(task.state) in TERMINAL:
                end = {"state": task.state, "exit_code": task.exit_code, "reason": task.reason}
                yield (json.dumps({"end": end}) + "\n").encode()
                return
            await wake.wait()


@router.get("/v1/tasks/{task_id}/logs", response_model=LogsOut, responses=ERRORS)
async def logs(
    task_id: str,
    _who: Viewer,
    store: StoreDep,
    hub: EventHubDep,
    after: Annotated[int, Query(ge=0, le=BIGINT_MAX, description="return what comes after the chunk with this id")] = 0,
    cursor: Annotated[str | None, Query(max_length=64, description="return what comes after the chunk with this cursor")] = None,
    stream: Annotated[Literal["stdout", "stderr"] | None, Query(description="only this stream")] = None,
    offset: Annotated[int | None, Query(ge=0, le=BIGINT_MAX, description="with `stream`: from this byte of the stream on")] = None,
    attempt: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="only this attempt (with `offset`: the latest by default)")
    ] = None,
    encoding: Annotated[Literal["utf-8", "base64"], Query(description="how `data` carries the bytes")] = "utf-8",
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    follow: Annotated[bool, Query(description="stream NDJSON until the task ends")] = False,
) -> Any:
    """A task's output in the order it was written, byte for byte (see LogChunkOut and LogsOut for
    offsets, cursors and resuming)."""
    tid = await task_ref(store, task_id)
    task = await store.get_task(tid)
    if cursor is not None and after:
        raise InvalidRequest("give either after or cursor, not both; cursor is the one to use")
    if offset is not None and stream is None:
        raise InvalidRequest("offset is a byte of one stream: give stream=stdout or stream=stderr with it")
    if cursor is not None:
        position: tuple[int, int, str] | None = _parse_log_cursor(cursor)
    elif after:
        position = await store.log_position(tid, after)
        if position is None:
            raise InvalidRequest(f"after={after} is no chunk of this task; give the id of a chunk it returned, or 0")
    else:
        position = None
    if offset is not None and attempt is None:
        attempt = task.attempts or None  # offsets count within one attempt: the latest one
    read = _LogRead(tid, position, stream, attempt, offset or 0, encoding)
    if not follow:
        rows = await read.page(store, limit)
        return LogsOut(
            chunks=[read.chunk(r) for r in rows],
            next_after=rows[-1].id if rows else after,
            next_cursor=_log_cursor(read.position) if read.position else None,
            task_state=task.state,
            terminal=TaskState(task.state) in TERMINAL,
        )
    # the hub's LISTEN is up before the first read, or a chunk stored between the two would wake no
    # one; a database not reachable yet is a 503 here, not a cut stream
    await hub.ensure_started()
    return StreamingResponse(_follow(store, hub, read), media_type="application/x-ndjson")
