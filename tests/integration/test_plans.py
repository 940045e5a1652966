"""A keyed store's sessions never read a whole table where an index serves: the group commit's
statements are prepared once per connection, and PostgreSQL keeps the generic plan it made while the
table was small (a new server's first seconds) until the table's statistics change. Planned then,
an unkeyed session reads every row of `tasks` on each run as the table grows — the control here."""

from __future__ import annotations

import asyncio
import re
import uuid

from podium.api.events import EventHub
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.queries import queries
from podium.store.ui import UiStore
from tests.integration.helpers import add_node, place, submit

# What the gateway's keyed pool runs (its group commits and the placements they make, log flushes,
# outbox takes and release proofs), each with the indexes it may read whole because that is its job. (The dispatch passes'
# pool is keyed too; its reservation still reads the nodes' primary key whole on a new database.)
KEYED_STATEMENTS: dict[str, set[str]] = {
    "lock_tasks": set(),
    "lock_task_facts": set(),
    "lock_task_facts_storing_logs": set(),
    "lock_nodes_of_tasks": set(),
    "transition_tasks": set(),
    "insert_logs": set(),
    "take_outbox": {"attempts_outbox"},  # the partial index holds just the deliveries still owed
    "give_back_assigns": set(),
    "release_proofs": set(),
    "lock_nodes": set(),
    # a group commit of ends places on the room it frees (`Refill`): the room, the claim, the write
    "refill_room": set(),
    "claim_queued": {"tasks_queued"},  # the queue's head, in claim order: what a claim is for
    "assign_tasks": {"nodes_pkey"},  # the reservation, as a pass's (above)
    "wake_dispatch": set(),
}

_WHOLE_INDEX = re.compile(r"Index (?:Only )?Scan(?: Backward)? using (\w+)")


def whole_reads(plan: list[str]) -> list[str]:
    """What a plan reads whole: a table scanned, an index walked with no condition of its own."""
    found = []
    for i, line in enumerate(plan):
        if "Seq Scan" in line:
            found.append(line.strip())
        m = _WHOLE_INDEX.search(line)
        if m and "Index Cond" not in (plan[i + 1] if i + 1 < len(plan) else ""):
            found.append(m.group(1))
    return found


async def test_a_keyed_session_plans_every_statement_of_its_pool_as_lookups_by_key(store: Store, db_url: str) -> None:
    """Planned generically on a new database's small tables (a few tasks, no attempt yet), as a
    server's first seconds plan them: each row is found by its key, and no table, and no index but
    the ones a statement reads by design, is read whole. The same plans in an unkeyed session scan
    whole tables (the control)."""
    for _ in range(3):
        await submit(store)
    q = queries()
    found: dict[str, dict[str, list[str]]] = {}
    for name, keyed in (("plain", False), ("keyed", True)):
        s = await Store.connect(db_url, min_size=1, max_size=1, keyed=keyed)
        try:
            async with s.pool.acquire() as c:
                await c.execute("SET plan_cache_mode = force_generic_plan")
                found[name] = {}
                for statement in KEYED_STATEMENTS:
                    prepared = await c.prepare(q[statement])
                    nulls = ", ".join(["NULL"] * len(prepared.get_parameters()))
                    # EXPLAIN plans the statement and runs nothing of it
                    args = f"({nulls})" if nulls else ""
                    plan = [r[0] for r in await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}{args}")]
                    found[name][statement] = [w for w in whole_reads(plan) if w not in KEYED_STATEMENTS[statement]]
        finally:
            await s.close()
    assert {k: v for k, v in found["keyed"].items() if v} == {}
    # the control: the plans the keyed settings refuse are the ones PostgreSQL makes here
    assert any("Seq Scan on tasks" in w for w in found["plain"]["transition_tasks"]), found["plain"]["transition_tasks"]


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


def per_row_cte_lookups(plan: list[str]) -> list[str]:
    """The CTEs a plan scans once for each row of another: a `CTE Scan` under a `SubPlan` (an
    InitPlan runs once, and is no such lookup)."""
    found = []
    for i, line in enumerate(plan):
        if "SubPlan" not in line:
            continue
        depth = len(line) - len(line.lstrip())
        for below in plan[i + 1 :]:
            if len(below) - len(below.lstrip()) <= depth:
                break
            if m := re.search(r"CTE Scan on (\w+)", below):
                found.append(m.group(1))
    return found


async def test_the_group_commits_statement_looks_nothing_up_in_its_ctes_row_by_row(store: Store) -> None:
    """A CTE has no index: a lookup in one for each row of a batch is a scan of it for each row,
    quadratic in the batch (20 ms of PostgreSQL's CPU at 930 rows). The group commit's statement
    reads its `ended` and `moved` rows only in steps that run once."""
    async with store.pool.acquire() as c:
        await c.execute("SET plan_cache_mode = force_generic_plan")
        prepared = await c.prepare(queries()["transition_tasks"])
        plan = [r[0] for r in await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}(NULL, true)")]
    assert any("CTE Scan on ended" in line for line in plan)  # what the check looks for is there
    assert per_row_cte_lookups(plan) == [], "\n".join(plan)
    # the control: the lookup the statement made until the nineteenth session
    looked_up = ["SubPlan 1", "  ->  Limit", "        ->  CTE Scan on ended e2", "        ->  CTE Scan on moved m2"]
    assert per_row_cte_lookups(looked_up) == ["ended", "moved"]


async def test_the_event_hubs_read_has_no_parameter_but_its_cursor_and_limit(store: Store) -> None:
    """The hub reads every event, so its statement names the filters as constants: the planner folds
    them away, and nothing but the cursor and the limit is left for a plan to depend on. With the
    filters as parameters (the followers' statement, which the hub read through until the nineteenth
    session), PostgreSQL planned the read anew each time while many events followed the cursor, ~0.9
    ms of a 1.3 ms read (docs/benchmarks.md). The control: the followers' statement."""
    q = queries()
    async with store.pool.acquire() as c:
        hub, follower = [[p.name for p in (await c.prepare(q[n])).get_parameters()] for n in ("hub_read", "events_after")]
    assert hub == ["text", "int8", "int8", "int8"]  # the cursor (txid, id, floor) and the limit
    assert follower == [*hub, "uuid", "text", "text[]", "bool", "bool"]


def scans_of(plan: list[str], table: str) -> int:
    """How many times a plan reads `table` (a scan of it, whatever its kind)."""
    return sum(1 for line in plan if re.search(rf"Scan(?: using \w+)? on {table}\b", line))


async def test_a_dispatch_pass_counts_its_window_once(store: Store) -> None:
    """The pass's first read counts the assignments its nodes have not accepted yet (the window) and
    compares the count with the window in its join: pulled up into the join, that count was run
    twice, once for the column and once for the condition (~1.5 ms a pass at 1,600 assignments)."""
    await submit(store)
    q = queries()["dispatch_facts"]
    async with store.pool.acquire() as c:
        plan = [r[0] for r in await c.fetch(f"EXPLAIN {q}", 4096, None, 0)]
    assert scans_of(plan, "tasks") == 1, "\n".join(plan)
    # the control: the count inlined where it is used
    before = q.replace("WITH f AS MATERIALIZED (", "WITH f AS NOT MATERIALIZED (")
    assert before != q
    async with store.pool.acquire() as c:
        plan = [r[0] for r in await c.fetch(f"EXPLAIN {before}", 4096, None, 0)]
    assert scans_of(plan, "tasks") >= 2, "\n".join(plan)


async def test_a_dispatch_pass_reads_the_operations_once_whatever_number_of_nodes_changed(store: Store) -> None:
    """The pass's first read carries each node's capacity operations once, on its first row, not
    beside every changed node: with N nodes changed and N holding operations that was N × N values
    (~460,000 in a pass of the lifecycle benchmark, 200 ms of it). The nodes and their room still
    come one row each, and a pass still places by what it read."""
    nodes = 12
    for i in range(nodes):
        await add_node(store, f"n{i:02d}", slots=1)
    for _ in range(nodes):
        await submit(store)
    assert len((await place(store)).assigned) == nodes  # one assignment waiting on each node
    q = queries()["dispatch_facts"]
    async with store.pool.acquire() as c:
        rows = await c.fetch(q, 4096, None, 0)  # every node read, as after a restart
    assert sorted(r["id"] for r in rows) == [f"n{i:02d}" for i in range(nodes)]
    carrying = [r for r in rows if r["operation_nodes"] is not None]
    assert len(carrying) == 1 and carrying[0] is rows[0], [len(r["operation_nodes"] or ()) for r in rows]
    assert dict(zip(rows[0]["operation_nodes"], rows[0]["operations"], strict=True)) == {f"n{i:02d}": 1 for i in range(nodes)}
    assert {r["in_flight"] for r in rows} == {nodes} and len({r["horizon"] for r in rows}) == 1
    # and what a pass makes of it: every node's one slot is taken, so a new task waits
    await submit(store)
    assert (await place(store)).assigned == []


async def test_a_dispatch_pass_reads_the_operations_apart_from_the_nodes_rows(store: Store) -> None:
    """The operations' arrays (an entry per node with an assignment or a provisioning in flight) are
    read once, not carried beside each node row through the join with the changed nodes: on 5,000 nodes
    with 4,000 assignments in flight that join's hash held 5,000 copies of both arrays, and a read of
    every node spilled ~500 MB to temporary files and took ~490 ms (75 ms read apart)."""
    nodes = 6
    for i in range(nodes):
        await add_node(store, f"n{i:02d}", slots=1)
    for _ in range(nodes):
        await submit(store)
    assert len((await place(store)).assigned) == nodes
    q = queries()["dispatch_facts"]
    async with store.pool.acquire() as c:
        plan = [r[0] for r in await c.fetch(f"EXPLAIN (VERBOSE, COSTS OFF) {q}", 4096, None, 0)]
    outputs = [line for line in plan if line.strip().startswith("Output:")]
    assert any("c.id" in line for line in outputs), "\n".join(plan)
    carrying = [line for line in outputs if "c.id" in line and ("o.nodes" in line or "o.counts" in line)]
    assert carrying == [], "\n".join(plan)


async def test_a_store_of_generic_plans_plans_a_group_commit_once_per_session(store: Store, db_url: str) -> None:
    """The gateway's reports store plans each statement once per session (its generic plan, which the
    first test shows is a lookup by key); a default session plans a batch of log chunks anew on every
    run, PostgreSQL estimating its custom plan cheaper (0.41 ms to plan, 0.21 to run, on the serial
    bench) — the control."""
    chunk = (uuid.uuid4(), 1, "stdout", 0, 0, b"x", "n1")  # no such attempt: kept by none, planned all the same
    plans: dict[str, tuple[int, int]] = {}
    for name, generic in (("default", False), ("generic", True)):
        s = await Store.connect(db_url, min_size=1, max_size=1, keyed=True, generic_plans=generic)
        try:
            for _ in range(8):
                await s.transition_decided([uuid.uuid4()], lambda rows: [], logs=[chunk])
            async with s.pool.acquire() as c:
                row = await c.fetchrow(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE strpos(statement, $1) = 1",
                    queries()["lock_task_facts_storing_logs"][:60],
                )
            plans[name] = (row["generic_plans"], row["custom_plans"])
        finally:
            await s.close()
    assert plans["generic"] == (8, 0)
    assert plans["default"][1] == 8, plans["default"]


async def test_the_event_hub_reads_on_a_session_that_plans_its_read_once(store: Store, db_url: str) -> None:
    """The hub reads after every commit that writes events. On a default session PostgreSQL plans that
    read anew at least five times, and once the stream is long, every time (its plan for the
    cursor's values estimated cheaper than the generic one, though both walk the stream's index from
    the cursor): ~1 ms to plan and 0.1 to run at 400,000 events (docs/benchmarks.md, twenty-sixth
    session). The server's hub reads on a session of its own that plans it once, and that generic
    plan reads no table whole. The control: a session of the API's pool, where the hub read before."""
    cursor = await UiStore(store).start_cursor()
    for _ in range(3):
        await submit(store)  # three events after the cursor
    # The hub reads only events older than every transaction running (its order): on a PostgreSQL
    # server shared with other tests' databases, another's transaction may hold them back a moment.
    # Once readable they stay so (a later transaction has a later id): wait for that, on another session.
    probe = EventHub(store, UiStore(store))
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        probe.head, probe._rows, probe._keys = cursor, [], []
        await probe._read()
        if len(probe._rows) == 3:
            break
        assert asyncio.get_running_loop().time() < deadline, "the three events were held back for 30 s"
        await asyncio.sleep(0.05)
    plans: dict[str, tuple[int, int]] = {}
    for name, generic in (("default", False), ("hub", True)):
        s = await Store.connect(db_url, min_size=1, max_size=1, keyed=generic, generic_plans=generic)
        try:
            hub = EventHub(store, UiStore(store), reads=UiStore(s))
            for _ in range(8):
                hub.head, hub._rows, hub._keys = cursor, [], []
                await hub._read()
                assert [(r.kind, r.state) for r in hub._rows] == [("task", "queued")] * 3
            async with s.pool.acquire() as c:
                row = await c.fetchrow(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE strpos(statement, $1) = 1",
                    queries()["hub_read"][:60],
                )
                if generic:  # its generic plan, as the session made it: the stream's indexes walked from the cursor
                    prepared = await c.prepare(queries()["hub_read"])
                    plan = [r[0] for r in await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}(NULL, NULL, NULL, NULL)")]
                    assert whole_reads(plan) == [], "\n".join(plan)
            plans[name] = (row["generic_plans"], row["custom_plans"])
        finally:
            await s.close()
    assert plans["hub"] == (8, 0)
    assert plans["default"][1] >= 5, plans["default"]


def cte_nested_loops(plan: list[str]) -> list[str]:
    """The nested loops of a plan that join two CTEs: each row of one compared with every row of the
    other (a CTE has no index, and the planner knows no CTE's size, so it guesses one row for each)."""
    found = []
    for i, line in enumerate(plan):
        if "Nested Loop" not in line:
            continue
        # EXPLAIN's text puts a node's children's arrows two columns right of where its own name starts
        depth = (line.index("->") + 4 if "->" in line else len(line) - len(line.lstrip())) + 2
        children = []
        for below in plan[i + 1 :]:
            if "->" in below and below.index("->") < depth:
                break  # past this node's subtree
            if "->" in below and below.index("->") == depth:
                children.append(below)
        if sum("CTE Scan" in c for c in children) >= 2:
            found.append(line.strip())
    return found


async def test_a_dispatch_passs_write_joins_none_of_its_ctes_row_by_row(store: Store) -> None:
    """The pass's write returns its reserved nodes and its assignments. Joined (each node with its
    assignments), the two CTEs were compared row by row: 250,000 comparisons, ~40 ms of a 146 ms
    write for a pass of 500 on 500 nodes at 5,000 nodes (docs/benchmarks.md, twenty-sixth session).
    The rows of each now come one after the other. The control: the statement as it was."""
    q = queries()["assign_tasks"]
    async with store.pool.acquire() as c:
        await c.execute("SET plan_cache_mode = force_generic_plan")
        nulls = ", ".join(["NULL"] * 13)
        prepared = await c.prepare(q)
        plan = [r[0] for r in await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}({nulls})")]
        assert any("CTE Scan on t" in line for line in plan)  # what the check looks for is there
        assert cte_nested_loops(plan) == [], "\n".join(plan)
        tail = q[q.index("SELECT r.id AS reserved") :]
        before = q.replace(tail, "SELECT r.id AS reserved, t.id FROM r LEFT JOIN t ON t.node_id = r.id")
        prepared = await c.prepare(before)
        plan = [r[0] for r in await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}({nulls})")]
    assert cte_nested_loops(plan) != [], "\n".join(plan)


async def test_a_statement_given_queued_tasks_finds_each_by_its_key_when_the_statistics_say_the_queue_is_empty(
    store: Store, db_url: str
) -> None:
    """Statistics gathered while nothing was queued (a quiet fleet's usual state; on a table of many
    finished tasks a burst of submissions does not bring ANALYZE back soon) made the planner guess the
    queue one row long. A dispatch pass's write then read the queue's head in tasks_queued for each of
    its placements, and its claimed tasks are that head: a pass of 500 read 125,000 index entries, 172
    ms of a 212 ms write (docs/benchmarks.md, thirtieth session); the reasons written for the tasks it
    could not place, and the image resolver's two writes, read the whole queue. Each now finds its
    tasks by their primary key. The control: each statement as it was."""
    await add_node(store, "n1", slots=64)
    for _ in range(20):
        await submit(store)
    assert len((await place(store)).assigned) == 20
    async with store.pool.acquire() as c:
        await c.execute("ALTER TABLE tasks SET (autovacuum_enabled = false)")  # the statistics stay as they are
        await c.execute("ANALYZE tasks")  # nothing queued
    for _ in range(60):
        await submit(store)
    q = queries()
    tasks_ = ("WHERE tasks.id = d.id AND (tasks.state = 'queued') IS TRUE", "WHERE tasks.id = d.id AND tasks.state = 'queued'")
    t_ = ("WHERE t.id = d.id AND (t.state = 'queued') IS TRUE", "WHERE t.id = d.id AND t.state = 'queued'")
    as_it_was = {"assign_tasks": tasks_, "set_queued_reasons": tasks_, "set_resolved": t_, "set_unresolved": t_}
    plans: dict[tuple[str, str, bool], str] = {}
    keyed = await Store.connect(db_url, min_size=1, max_size=1, keyed=True)  # as the dispatch passes' pool is
    try:
        for session in (keyed, store):
            async with session.pool.acquire() as c:
                await c.execute("SET plan_cache_mode = force_generic_plan")
                for name, (now, before) in as_it_was.items():
                    assert now in q[name]
                    for label, sql in (("now", q[name]), ("before", q[name].replace(now, before))):
                        prepared = await c.prepare(sql)
                        nulls = ", ".join(["NULL"] * len(prepared.get_parameters()))
                        plan = await c.fetch(f"EXPLAIN EXECUTE {prepared.get_name()}({nulls})")
                        plans[name, label, session is keyed] = "\n".join(r[0] for r in plan)
    finally:
        await keyed.close()
    for (name, label, is_keyed), plan in plans.items():
        where = f"{name} ({'as it was' if label == 'before' else 'now'}, {'keyed' if is_keyed else 'plain'} session)"
        if label == "now":
            assert "tasks_queued" not in plan, f"{where}:\n{plan}"
            if is_keyed:
                assert "tasks_pkey" in plan, f"{where}:\n{plan}"
        else:
            assert "tasks_queued" in plan, f"{where}:\n{plan}"


async def test_a_keyed_store_claims_the_queues_head_in_its_order_whatever_the_statistics(store: Store, db_url: str) -> None:
    """With no statistics yet (a new server's first minute) or ones gathered while little was queued,
    the planner guessed the queue a few dozen rows long: the dispatch claim then read the whole queue
    through a bitmap and sorted it for the 512 at its head (27 ms at 20,000 queued; an 8 MB sort on
    disk at 15,000 in a benchmark's backlog). A keyed session (the dispatch passes' pool, the group
    commits' refills) reads tasks_queued in its order and stops at the limit. The control: the same
    session with bitmap scans allowed."""
    async with store.pool.acquire() as c:
        await c.execute("ALTER TABLE tasks SET (autovacuum_enabled = false)")  # never analyzed, as in a new server
    for _ in range(4):
        await store.submit_many([(TaskSpec(command=["true"]), None) for _ in range(5000)], actor="test")
    q = queries()["claim_queued"]
    plans: dict[str, list[str]] = {}
    keyed = await Store.connect(db_url, min_size=1, max_size=1, keyed=True)
    try:
        async with keyed.pool.acquire() as c:
            for label in ("keyed", "control"):
                if label == "control":
                    await c.execute("SET enable_bitmapscan = on")
                async with c.transaction():  # the claim locks what it reads, until this block's commit
                    plans[label] = [r[0] for r in await c.fetch(f"EXPLAIN (ANALYZE) {q}", 512, [], [], [])]
    finally:
        await keyed.close()

    def sorted_whole(plan: list[str]) -> bool:
        return any("Sort Key: t.priority" in line for line in plan)

    assert not sorted_whole(plans["keyed"]), "\n".join(plans["keyed"])
    assert any("Index Scan using tasks_queued" in line for line in plans["keyed"]), "\n".join(plans["keyed"])
    assert sorted_whole(plans["control"]), "\n".join(plans["control"])
