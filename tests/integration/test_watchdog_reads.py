"""The watchdog's sweep (every second) reads what is due, not every live task (migration 0017): with
many tasks running and nothing due, its statements read no row of `tasks`, and each kind of task due
is still found, with its reason."""

from __future__ import annotations

import json
from typing import Any

from podium.store import Store
from podium.store.queries import queries
from tests.integration.helpers import add_node, place, running_on, submit

# the sweep's statements that look at live tasks, with their parameters (the limit)
SWEEP = {"watch_lost": (100,), "watch_timeouts": (100,), "drain_overdue": (100,), "handover_due": (100,)}


def task_rows_read(node: dict[str, Any]) -> int:
    """Rows of `tasks` (its heap or any of its indexes) a plan node and those under it read: what
    each returned over its loops, and what its filters threw away."""
    own = 0
    if node.get("Relation Name") == "tasks" or str(node.get("Index Name", "")).startswith("tasks"):
        own = int(node.get("Actual Rows", 0) * node.get("Actual Loops", 1)) + int(node.get("Rows Removed by Filter", 0))
    return own + sum(task_rows_read(child) for child in node.get("Plans", []))


async def reads(store: Store) -> dict[str, int]:
    """Each sweep statement run once under EXPLAIN ANALYZE, as PostgreSQL runs it on a large table:
    told to use an index wherever one serves (on a test's few rows a whole scan is cheaper)."""
    q = queries()
    out = {}
    async with store.pool.acquire() as c:
        await c.execute("SET enable_seqscan = off")
        try:
            for name, args in SWEEP.items():
                explained = await c.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {q[name]}", *args)
                [plan] = json.loads(explained) if isinstance(explained, str) else explained
                out[name] = task_rows_read(plan["Plan"])
        finally:
            await c.execute("RESET enable_seqscan")
    return out


async def test_a_sweep_with_nothing_due_reads_no_live_task(store: Store) -> None:
    await add_node(store, "n1", slots=40)
    await running_on(store, "n1", 30)  # no timeout: no lease once running
    await running_on(store, "n1", 5, timeout=3600)  # a timeout an hour away
    await submit(store)
    await place(store)  # one more assigned: a lease 5 minutes away, an accept deadline 15 s away
    assert await reads(store) == dict.fromkeys(SWEEP, 0)
    assert await store.lost_tasks(100) == []
    assert await store.timed_out(100) == []
    assert await store.drain_overdue(100) == []
    assert await store.handover_due(100) == []


async def test_what_is_due_is_found_and_only_that(store: Store) -> None:
    await add_node(store, "n1", slots=10)
    on_n1 = await running_on(store, "n1", 3)
    await add_node(store, "n2", slots=10)
    await add_node(store, "n3", slots=10)
    lapsed, offline, overdue = on_n1
    async with store.pool.acquire() as c:
        # a lease run out (as a lost node's task holds), a node gone offline, a drain past its deadline
        await c.execute("UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE id = $1", lapsed[0])
        await c.execute("UPDATE tasks SET node_id = 'n2' WHERE id = $1", offline[0])
        await c.execute("UPDATE nodes SET health = 'offline' WHERE id = 'n2'")
        await c.execute("UPDATE tasks SET node_id = 'n3' WHERE id = $1", overdue[0])
    await store.set_draining("n2", True)  # the others placed on: not on n2 (or n3, once draining)
    await store.set_draining("n3", True, 0.0)
    [timing_out] = await running_on(store, "n1", 1, timeout=1)
    async with store.pool.acquire() as c:
        await c.execute("UPDATE tasks SET started_at = now() - interval '2 seconds' WHERE id = $1", timing_out[0])
    lost = {r.id: r.why for r in await store.lost_tasks(100)}
    assert lost == {lapsed[0]: "lease", offline[0]: "offline"}
    assert [r.id for r in await store.timed_out(100)] == [timing_out[0]]
    assert [r.id for r in await store.drain_overdue(100)] == [overdue[0]]
    # what is due is all any statement read: each row at most twice (found by its index, then read)
    read, due = await reads(store), {"watch_lost": 2, "watch_timeouts": 1, "drain_overdue": 1, "handover_due": 0}
    assert {k: n for k, n in read.items() if n > 2 * due[k]} == {}, read
