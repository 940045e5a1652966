"""Log chunks in the store, against real PostgreSQL (embedded and 15): read back in the order the
agent numbered them whatever order they were inserted in, stored once however often sent, resumable
from a position or a byte offset."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import asyncpg
import pytest

from podium.store import Store
from podium.store.migrate import migration_files
from tests.conftest import PgServer, _with_db
from tests.integration.helpers import Statements, add_node, place, submit


async def placed(store: Store) -> tuple[uuid.UUID, int]:
    await add_node(store, slots=64, cpu=64_000, memory=64 * 2**30)
    # other attempts in the table, so the insert's join is planned as on a real fleet
    for _ in range(30):
        await submit(store)
    tid = await submit(store)
    out = await place(store)
    token = next(tok for t, _n, tok in out.assigned if t == tid)
    return tid, token


def chunk(tid: uuid.UUID, token: int, seq: int, stream: str, offset: int, data: bytes) -> tuple:
    return (tid, token, stream, seq, offset, data, "n1")


async def test_chunks_read_back_in_seq_order_once_each(store: Store) -> None:
    tid, token = await placed(store)
    lines = [(f"out{i}\n".encode(), f"err{i}\n".encode()) for i in range(50)]
    chunks, offsets, seq = [], {"stdout": 0, "stderr": 0}, 0
    for out, err in lines:
        for stream, data in (("stdout", out), ("stderr", err)):
            chunks.append(chunk(tid, token, seq, stream, offsets[stream], data))
            offsets[stream] += len(data)
            seq += 1
    # stored in batches, each of them repeated (a node sends again what no server acknowledged),
    # the second half before the first
    await store.insert_logs(chunks[50:])
    await store.insert_logs(chunks[:60])
    await store.insert_logs(chunks)
    rows = await store.read_logs(tid, limit=1000)
    assert [r.seq for r in rows] == list(range(100))
    assert [bytes(r.data) for r in rows] == [c[5] for c in chunks]
    assert [r.byte_offset for r in rows] == [c[4] for c in chunks]

    # from a position: exactly what follows it
    last = rows[41]
    rest = await store.read_logs(tid, after=(last.fencing_token, last.seq, last.stream), limit=1000)
    assert [r.seq for r in rest] == list(range(42, 100))
    # one stream from a byte: the chunks that hold it and what follows
    err = await store.read_logs(tid, stream="stderr", offset=13, limit=1000)
    assert err[0].byte_offset <= 13 < err[0].byte_offset + len(err[0].data)
    assert b"".join(bytes(r.data) for r in err)[13 - err[0].byte_offset :] == b"".join(e for _o, e in lines)[13:]
    # the first API's cursor: a chunk's id names its position
    pos = await store.log_position(tid, rows[10].id)
    assert pos == (token, 10, rows[10].stream)
    assert await store.log_position(tid, 10**12) is None


async def test_chunks_of_an_attempt_not_on_that_node_are_not_stored(store: Store) -> None:
    tid, token = await placed(store)
    await store.insert_logs([(tid, token, "stdout", 0, 0, b"mine\n", "n1"), (tid, token, "stdout", 1, 5, b"not\n", "n2")])
    assert [bytes(r.data) for r in await store.read_logs(tid)] == [b"mine\n"]


@pytest.fixture
def unmigrated_url(pg: PgServer) -> Iterator[str]:
    """An empty database on either server: migrations are applied by the test itself."""
    name = f"podium_t_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg.admin_url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    url = _with_db(pg.admin_url, name)
    yield url
    pg.drop_database(url)


async def test_output_stored_before_offsets_keeps_its_bytes_and_order_within_each_stream(unmigrated_url: str) -> None:
    conn = await asyncpg.connect(unmigrated_url)
    try:
        await conn.execute(
            "CREATE TABLE schema_migrations (version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        # every migration but 0006 (no later one touches log_chunks), so the store's code of today can
        # place a task on this schema; 0006 then meets output stored the old way
        for version, name, sql in migration_files():
            if version != 6:
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name)
    finally:
        await conn.close()
    store = await Store.connect(unmigrated_url, min_size=1, max_size=2)
    try:
        tid, token = await placed(store)
        # as the previous version stored them: seq per stream, two flushes
        async with store.pool.acquire() as c:
            await c.executemany(
                "INSERT INTO log_chunks (task_id, fencing_token, stream, seq, data, at) VALUES ($1, $2, $3, $4, $5, $6::text::timestamptz)",
                [(tid, token, "stdout", 1, b"o2\n", "2026-01-01T00:00:01Z"), (tid, token, "stdout", 0, b"o1\n", "2026-01-01T00:00:00Z"),
                 (tid, token, "stderr", 0, b"e1\n", "2026-01-01T00:00:00Z"), (tid, token, "stderr", 1, b"e2\n", "2026-01-01T00:00:01Z")],
            )  # fmt: skip
        assert "0006_log_offsets.sql" in await store.migrate()
        rows = await store.read_logs(tid)
        assert [r.seq for r in rows] == [0, 1, 2, 3]
        assert [(r.stream, bytes(r.data), r.byte_offset) for r in rows] == [
            ("stderr", b"e1\n", 0), ("stdout", b"o1\n", 0), ("stderr", b"e2\n", 3), ("stdout", b"o2\n", 3)]  # fmt: skip
    finally:
        await store.close()


class Heard:
    """A LISTEN on podium_logs of its own, as a replica's event hub has."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.payloads: list[str] = []

    async def __aenter__(self) -> Heard:
        self.sub = await self.store.listen("podium_logs", self.payloads.append)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.sub.close()

    async def settled(self) -> list[str]:
        """Every payload heard up to now: a marker NOTIFY sent after the writes arrives after theirs
        (one session's notifications are delivered in commit order), so once it is heard all are."""
        async with self.store.pool.acquire() as c:
            await c.execute("SELECT pg_notify('podium_logs', 'marker')")
        for _ in range(400):
            if "marker" in self.payloads:
                break
            await asyncio.sleep(0.025)
        assert "marker" in self.payloads, "the marker NOTIFY never arrived"
        got = self.payloads[: self.payloads.index("marker")]
        del self.payloads[: self.payloads.index("marker") + 1]
        return got


async def test_one_insert_notifies_each_task_written_once_and_a_resend_nobody(store: Store) -> None:
    tid, token = await placed(store)
    other = await submit(store)
    out = await place(store)
    other_token = next(tok for t, _n, tok in out.assigned if t == other)
    chunks = [chunk(tid, token, seq, "stdout", seq, b"x") for seq in range(20)]
    chunks += [chunk(other, other_token, seq, "stderr", seq, b"y") for seq in range(5)]
    async with Heard(store) as heard:
        await store.insert_logs(chunks)
        payloads = await heard.settled()
        # one NOTIFY for the statement, each task named once however many of its chunks it stored
        assert len(payloads) == 1
        assert sorted(payloads[0].split(",")) == sorted([str(tid), str(other)])
        # sent again (no server acknowledged them): stored once already, nothing new, no wake
        await store.insert_logs(chunks)
        assert await heard.settled() == []
        # refused (not that node's attempt): nothing stored, no wake
        await store.insert_logs([(tid, token, "stdout", 99, 99, b"z", "n2")])
        assert await heard.settled() == []


async def test_an_insert_for_many_tasks_splits_its_notify_below_the_payload_limit(store: Store) -> None:
    await add_node(store, slots=512, cpu=512_000, memory=512 * 2**30)
    tids = [await submit(store) for _ in range(450)]
    out = await place(store)
    tokens = {t: tok for t, _n, tok in out.assigned}
    assert set(tokens) == set(tids)
    async with Heard(store) as heard:
        await store.insert_logs([chunk(t, tokens[t], s, "stdout", s, b"x") for t in tids for s in range(2)])
        payloads = await heard.settled()
    assert len(payloads) == 3  # 200 + 200 + 50 ids
    assert all(len(p.encode()) < 8000 for p in payloads)
    named = [t for p in payloads for t in p.split(",")]
    assert sorted(named) == sorted(str(t) for t in tids)


async def test_a_group_commit_stores_its_output_with_the_read_of_its_tasks_and_tells_followers_whatever_it_finds(
    store: Store,
) -> None:
    """A group commit's output chunks are stored by the statement that locks and reads its tasks (one
    round trip, not two): stored and told when the reported task is found, and when none is (the
    chunks are other tasks'), and the read is what it was."""
    tid, token = await placed(store)
    order: list[str] = []
    store.q = Statements(store.q, order)
    async with Heard(store) as heard:
        decided: list[dict] = []
        await store.transition_decided([tid], lambda rows: decided.append(dict(rows)) or [],
                                       logs=[chunk(tid, token, 0, "stdout", 0, b"a\n")])  # fmt: skip
        assert [f.state for f in decided[0].values()] == ["assigned"] and list(decided[0]) == [tid]
        assert await heard.settled() == [str(tid)]
        # no task of the batch is found: the output is stored and told all the same, and nothing is read
        await store.transition_decided([uuid.uuid4()], lambda rows: decided.append(dict(rows)) or [],
                                       logs=[chunk(tid, token, 1, "stdout", 2, b"b\n")])  # fmt: skip
        assert decided[1] == {}
        assert await heard.settled() == [str(tid)]
    assert [bytes(r.data) for r in await store.read_logs(tid, limit=10)] == [b"a\n", b"b\n"]
    assert "insert_logs" not in order and order.count("lock_task_facts_storing_logs") == 2

