"""The store's reads and writes for the event stream and the web UI (queries/ui.sql). Kept beside
`Store` rather than in it so the two grow apart without conflict; it runs queries only through the
store's pool and error translation, and it never changes a task or a node.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from podium.store.db import Store
from podium.store.rows import NamedSpecRow, StreamEventRow, TaskSummaryRow, UiSessionRow


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A position in the event stream: events sort by (txid, id). `floor` is set when a client
    resumed from an event id no longer stored: it then gets only events with a higher id."""

    txid: int
    id: int
    floor: int = 0


class UiStore:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def start_cursor(self) -> Cursor:
        async with self.store._conn() as conn:
            return Cursor(int(await conn.fetchval(self.store.q["events_start"])), 0)

    async def cursor_of(self, event_id: int) -> Cursor:
        """Where a client that last saw event `event_id` resumes."""
        async with self.store._conn() as conn:
            txid = await conn.fetchval(self.store.q["event_txid"], event_id)
        if txid is None:
            return Cursor(0, 0, event_id)
        return Cursor(int(txid), event_id)

    async def events_after(
        self,
        cursor: Cursor,
        limit: int,
        *,
        task_id: uuid.UUID | None = None,
        node_id: str | None = None,
        states: list[str] | None = None,
        tasks: bool = True,
        nodes: bool = True,
    ) -> list[StreamEventRow]:
        async with self.store._conn() as conn:
            rows = await conn.fetch(
                self.store.q["events_after"], str(cursor.txid), cursor.id, cursor.floor, limit, task_id, node_id, states, tasks, nodes
            )
        return StreamEventRow.many(rows)

    async def hub_read(self, cursor: Cursor, limit: int) -> tuple[list[StreamEventRow], bool]:
        """The event hub's read: events_after, unfiltered, and whether events after `cursor` are held back
        behind an open transaction (one that may end without a NOTIFY), in one round trip."""
        async with self.store._conn() as conn:
            rows = await conn.fetch(self.store.q["hub_read"], str(cursor.txid), cursor.id, cursor.floor, limit)
        held = bool(rows) and rows[-1]["kind"] == "held"
        return StreamEventRow.many(rows[:-1] if held else rows), held

    async def tasks_page(
        self,
        *,
        before: tuple[datetime, uuid.UUID] | None,
        state: str | None,
        name: str | None,
        node_id: str | None,
        labels: dict[str, str] | None,
        limit: int,
    ) -> list[TaskSummaryRow]:
        at, tid = before if before else (None, None)
        async with self.store._conn() as conn:
            rows = await conn.fetch(self.store.q["ui_tasks_page"], at, tid, state, name, node_id, labels or None, limit)
        return TaskSummaryRow.many(rows)

    async def spec_revisions(self, name: str) -> list[NamedSpecRow]:
        async with self.store._conn() as conn:
            return NamedSpecRow.many(await conn.fetch(self.store.q["ui_spec_revisions"], name))

    async def create_session(self, session_hash: bytes, token_id: str, csrf: str, ttl_seconds: float) -> None:
        async with self.store._conn() as conn:
            await conn.execute(self.store.q["ui_session_insert"], session_hash, token_id, csrf, ttl_seconds)

    async def session(self, session_hash: bytes) -> UiSessionRow | None:
        """The live session with this hash, or None (unknown, ended or expired)."""
        async with self.store._conn() as conn:
            row = await conn.fetchrow(self.store.q["ui_session_get"], session_hash)
        return None if row is None else UiSessionRow.of(row)

    async def end_session(self, session_hash: bytes) -> None:
        async with self.store._conn() as conn:
            await conn.execute(self.store.q["ui_session_delete"], session_hash)
