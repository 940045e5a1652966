"""A keyed store's sessions never read a whole table where an index serves: the group commit's
statements are prepared once per connection, and PostgreSQL keeps the generic plan it made while the
table was small (a new server's first seconds) until the table's statistics change. Planned then,
an unkeyed session reads every row of `tasks` on each run as the table grows — the control here."""

from __future__ import annotations

import uuid

from podium.spec import TaskSpec
from podium.store import Store
from tests.integration.helpers import submit


async def seq_scans(store: Store) -> int:
    async with store.pool.acquire() as c:
        return int(await c.fetchval("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'tasks'"))


async def flushed(s: Store) -> None:
    """The statistics of the store's one session are in shared memory (flushed when it goes idle)."""
    async with s.pool.acquire() as c:
        await c.execute("SELECT pg_stat_force_next_flush()")
    async with s.pool.acquire() as c:
        await c.execute("SELECT 1")


async def test_a_keyed_store_reads_a_grown_table_by_its_index(store: Store, db_url: str) -> None:
    few = [await submit(store) for _ in range(3)]
    plain = await Store.connect(db_url, min_size=1, max_size=1)
    keyed = await Store.connect(db_url, min_size=1, max_size=1, keyed=True)
    try:
        for s in (plain, keyed):
            for _ in range(8):  # past the five custom plans PostgreSQL makes before it settles on one
                await s.transition_decided(few, lambda rows: [])
        await store.submit_many([(TaskSpec(command=["true"]), f"k{i}") for i in range(3000)], actor="test")
        scans = {}
        for name, s in (("plain", plain), ("keyed", keyed)):
            await flushed(s)
            before = await seq_scans(store)
            await s.transition_decided([*few, uuid.uuid4()], lambda rows: [])
            await flushed(s)
            scans[name] = await seq_scans(store) - before
        assert scans == {"plain": 1, "keyed": 0}
    finally:
        await plain.close()
        await keyed.close()
