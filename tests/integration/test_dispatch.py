"""Placement made durable: one transaction, fencing tokens, reservations within allocatable."""

from __future__ import annotations

import asyncio
from typing import Any

from podium import reasons
from podium.store import Store
from tests.integration.helpers import add_node, node_row, place, scheduler, submit, tick


async def test_no_node_gives_the_seed_reason(store: Store) -> None:
    tid = await submit(store)
    out = await place(store)
    assert out.assigned == [] and out.unplaced == {tid: reasons.NO_NODES}
    assert (await store.get_task(tid)).reason == reasons.NO_NODES


async def test_placement_writes_attempt_token_lease_and_reservation(store: Store) -> None:
    await add_node(store, "n1", slots=2)
    t1 = await submit(store, resources={"cpu": 1, "memory": "1Gi"})
    t2 = await submit(store, resources={"cpu": 1, "memory": "1Gi"})
    t3 = await submit(store, resources={"cpu": 1, "memory": "1Gi"})
    out = await place(store)
    assert {a[0] for a in out.assigned} == {t1, t2}
    assert out.unplaced == {t3: reasons.FULL}
    tokens = [a[2] for a in out.assigned]
    assert len(set(tokens)) == 2
    n = await node_row(store, "n1")
    assert (n["res_slots"], n["res_cpu_millis"], n["res_memory_bytes"]) == (2, 2000, 2 * 2**30)
    t = await store.get_task(t1)
    assert t.state == "assigned" and t.node_id == "n1" and t.attempts == 1
    assert t.lease_expires_at is not None and t.accept_deadline is not None
    _, attempts, events = await store.task_detail(t1)
    assert [(a.attempt, a.node_id, a.fencing_token) for a in attempts] == [(1, "n1", t.fencing_token)]
    assert [(e.from_state, e.to_state) for e in events] == [(None, "queued"), ("queued", "assigned")]


async def test_concurrent_dispatchers_never_over_reserve_or_double_place(store: Store) -> None:
    await add_node(store, "n1", slots=5)
    await add_node(store, "n2", slots=5)
    ids = [await submit(store) for _ in range(40)]
    scheds = [scheduler(store) for _ in range(4)]
    outs = await asyncio.gather(*(s.dispatch_once() for s in scheds))
    for _ in range(3):
        outs += await asyncio.gather(*(s.dispatch_once() for s in scheds))
    placed = [a[0] for o in outs for a in o.assigned]
    assert len(placed) == len(set(placed)) == 10
    for nid in ("n1", "n2"):
        n = await node_row(store, nid)
        assert n["res_slots"] <= n["alloc_slots"] == 5
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM attempts") == 10
        assert await c.fetchval("SELECT count(*) FROM tasks WHERE state = 'queued'") == 30
    assert set(placed) <= set(ids)


async def test_the_database_refuses_over_reservation_even_if_code_asks(store: Store) -> None:
    import asyncpg
    import pytest

    await add_node(store, "n1", slots=1)
    async with store.pool.acquire() as c:
        with pytest.raises(asyncpg.CheckViolationError):
            await c.execute("UPDATE nodes SET res_slots = 2 WHERE id = 'n1'")


async def test_migrations_are_idempotent(store: Store) -> None:
    assert await store.migrate() == []
    async with store.pool.acquire() as c:
        tables = {r["tablename"] for r in await c.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"nodes", "tasks", "attempts", "task_events", "log_chunks", "schema_migrations"} <= tables


async def test_finished_tasks_past_the_retention_are_pruned_with_their_history(store: Store) -> None:
    old = await submit(store)
    fresh = await submit(store)
    live = await submit(store)
    for tid in (old, fresh):
        assert await store.transition_task(tid, "queued", "cancelled", actor="test")
    async with store.pool.acquire() as c:
        await c.execute("UPDATE tasks SET finished_at = now() - interval '8 days' WHERE id = $1", old)
    assert await store.prune_finished(7 * 86400, 100) == 1
    async with store.pool.acquire() as c:
        left = {r["id"] for r in await c.fetch("SELECT id FROM tasks")}
        assert await c.fetchval("SELECT count(*) FROM task_events WHERE task_id = $1", old) == 0
        # and only its: the history of the tasks kept is all there
        assert await c.fetchval("SELECT count(*) FROM task_events WHERE task_id = $1", fresh) == 2
        assert await c.fetchval("SELECT count(*) FROM task_events WHERE task_id = $1", live) == 1
    assert left == {fresh, live}


async def test_the_dispatcher_stops_at_its_window_of_unaccepted_assignments(store: Store) -> None:
    """Placing faster than nodes accept only builds a backlog in which healthy nodes miss their accept
    deadlines: with `assign_window` assignments unaccepted, the next tick places nothing until one is."""
    import dataclasses

    from podium.scheduler.service import Scheduler
    from podium.states import AttemptState, TaskState
    from podium.timing import DEFAULT_TIMING

    await add_node(store, "n1", slots=10)
    ids = [await submit(store) for _ in range(5)]
    sched = Scheduler(store, dataclasses.replace(DEFAULT_TIMING, assign_window=3), server_id="test")
    first = await sched.dispatch_once()
    assert len(first.assigned) == 3 and not first.window_full
    second = await sched.dispatch_once()
    assert second.window_full and second.assigned == [] and second.claimed == 0
    tid, node, tok = first.assigned[0]
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.PROVISIONING, actor="node", fencing_token=tok,
                                       node_id=node, attempt_state=AttemptState.PROVISIONING)  # fmt: skip
    third = await sched.dispatch_once()
    assert len(third.assigned) == 1  # one accepted, one more placed
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM tasks WHERE state = 'queued'") == 1
    assert {a[0] for a in first.assigned + third.assigned} <= set(ids)


async def test_the_dispatcher_holds_while_its_gateway_is_behind_on_node_reports(store: Store) -> None:
    """An Assign placed while the node reports wait seconds for their group commit would have its
    acceptance queued behind them, past its deadline on an overloaded server: the dispatcher places
    nothing (and claims nothing) while its gateway is behind by more than a share of the deadline."""
    from podium.scheduler.dispatch import HOLD_SHARE
    from podium.timing import DEFAULT_TIMING

    await add_node(store, "n1", slots=10)
    tid = await submit(store)
    sched = scheduler(store)
    limit = DEFAULT_TIMING.provisioning_deadline * HOLD_SHARE
    behind = [limit + 0.5]
    sched.hold_while_behind(lambda: behind[0])
    held = await sched.dispatch_once()
    assert held.window_full and held.assigned == [] and held.claimed == 0
    assert (await store.get_task(tid)).state == "queued"
    behind[0] = limit - 0.5  # caught up enough
    out = await sched.dispatch_once()
    assert [a[0] for a in out.assigned] == [tid]


def _watched(sched: Any) -> tuple[list[set[str]], list[set[str]]]:
    """What each pass of `sched` was given of the nodes: the ids read whole, and the ids of which only
    the reservations were read (appended pass by pass)."""
    whole: list[set[str]] = []
    room: list[set[str]] = []
    plan = sched.dispatcher.plan

    def counting(*, whole_window):  # type: ignore[no-untyped-def]
        p = plan(whole_window=whole_window)
        begin = p.begin

        def seeing(changed, changed_room, horizon, operations):  # type: ignore[no-untyped-def]
            whole.append({r.id for r in changed})
            room.append({r.room_node for r in changed_room})
            return begin(changed, changed_room, horizon, operations)

        p.begin = seeing  # type: ignore[method-assign]
        return p

    sched.dispatcher.plan = counting
    return whole, room


async def test_a_dispatcher_keeps_its_nodes_between_ticks_and_reads_only_what_changed(store: Store) -> None:
    """One scheduler across ticks: after the first read it reads only node rows changed since (by
    its own reservations, by freed capacity, by an operator, by a node joining) and places on what
    is true now. Of a node whose reservations alone changed it reads only those; any other change
    brings the whole row. A heartbeat that changes nothing placement reads is not a change."""
    from podium.states import AttemptState, TaskState

    sched = scheduler(store)
    whole, room = _watched(sched)
    await add_node(store, "n1", slots=1)
    await add_node(store, "n2", slots=1)
    t1, t2, t3 = [await submit(store) for _ in range(3)]
    first = await tick(store, sched)
    assert len(first.assigned) == 2 and whole[-1] == {"n1", "n2"}  # the first read is every node, whole
    assert set(first.unplaced.values()) == {reasons.FULL}
    # nothing changed: the next tick reads its own reservations only (made after its last read), and
    # of those nodes only the reservations: nothing else of them changed
    marks = "SELECT id, changed_xid::text, facts_xid::text FROM nodes ORDER BY id"
    async with store.pool.acquire() as conn:
        before = await conn.fetch(marks)
        await store.heartbeats([("n1", 1), ("n2", 1)], "test")
        assert await conn.fetch(marks) == before  # heartbeats changed nothing placement reads
    again = await tick(store, sched)
    assert again.assigned == [] and (whole[-1], room[-1]) == (set(), {"n1", "n2"})
    assert {s.id: s.reserved.slots for s in sched.dispatcher._snaps.values()} == {"n1": 1, "n2": 1}
    # the tick after: nothing changed since (its horizon pinned, see `tick`), nothing read
    again = await tick(store, sched)
    assert again.assigned == [] and (whole[-1], room[-1]) == (set(), set())
    # capacity freed on n1 is seen at the next tick: its reservations, read alone
    tid, node, tok = next(a for a in first.assigned if a[1] == "n1")
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.SUCCEEDED, actor="node", fencing_token=tok,
                                       node_id=node, exit_code=0, end_attempt=AttemptState.EXITED)  # fmt: skip
    third = await tick(store, sched)
    assert [a[1] for a in third.assigned] == ["n1"] and "n1" in room[-1] and "n1" not in whole[-1]
    # an operator's drain and a new node are seen too, whole
    await store.set_draining("n1", True)
    await add_node(store, "n3", slots=1)
    t4 = await submit(store)
    fourth = await tick(store, sched)
    assert [a[1] for a in fourth.assigned] == ["n3"] and whole[-1] >= {"n1", "n3"}
    assert sched.dispatcher._snaps["n1"].draining
    assert {t1, t2, t3, t4} >= {a[0] for a in first.assigned + third.assigned + fourth.assigned}


async def test_a_nodes_gpus_freed_and_taken_are_seen_through_its_reservations_alone(store: Store) -> None:
    """The GPU indexes a node's attempts hold come with its reservations: a scheduler that keeps the
    node between ticks hands out a freed index again, and never one that is taken."""
    from podium.spec import TaskSpec
    from podium.states import AttemptState, TaskState

    sched = scheduler(store)
    whole, room = _watched(sched)
    assert await store.node_hello(
        node_id="g1", name="g1", pool="default", arch="x86_64", labels={}, capabilities=[], backends=["process"],
        artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[0, 1], cpu_millis=4000, memory_bytes=8 * 2**30,
        disk_bytes=10 * 2**30, gpus=2, slots=4, gateway_id="test", agent_version="test", max_operations=4,
    )  # fmt: skip

    async def one_gpu() -> Any:
        row, _ = await store.submit(TaskSpec(command=["true"], resources={"cpu": "100m", "memory": "64Mi", "gpus": 1}))
        return row.id

    async def indexes(tid: Any) -> list[int]:
        _, attempts, _ = await store.task_detail(tid)
        return list(attempts[-1].gpu_indexes)

    a = await one_gpu()
    first = await tick(store, sched)
    assert [x[0] for x in first.assigned] == [a] and whole[-1] == {"g1"}
    b = await one_gpu()
    second = await tick(store, sched)
    assert [x[0] for x in second.assigned] == [b] and (whole[-1], room[-1]) == (set(), {"g1"})
    assert sorted(await indexes(a) + await indexes(b)) == [0, 1]
    c = await one_gpu()
    third = await tick(store, sched)  # reads b's GPU taken (a pass remembers what it read, not what it placed)
    assert third.assigned == [] and list(third.unplaced) == [c] and (whole[-1], room[-1]) == (set(), {"g1"})
    assert sched.dispatcher._snaps["g1"].gpu_free == ()
    # a's end frees its GPU: read with the node's reservations alone, and handed to c
    _, node, tok = first.assigned[0]
    assert await store.transition_task(a, TaskState.ASSIGNED, TaskState.SUCCEEDED, actor="node", fencing_token=tok,
                                       node_id=node, exit_code=0, end_attempt=AttemptState.EXITED)  # fmt: skip
    fourth = await tick(store, sched)
    assert [x[0] for x in fourth.assigned] == [c] and "g1" in room[-1] and "g1" not in whole[-1]
    assert await indexes(c) == await indexes(a)


async def test_the_watchdog_gives_a_removed_nodes_tasks_the_removal_as_reason(store: Store) -> None:
    """Removing a node marks it offline and then applies the node-loss policy to its tasks. If the
    watchdog's sweep gets there first, it must say the same true thing: removed, not "went offline"."""
    await add_node(store, "n1", slots=2)
    keep = await submit(store, requeue_on_node_loss=False)
    again = await submit(store)
    out = await place(store)
    assert {a[0] for a in out.assigned} == {keep, again}
    await store.revoke_node("n1")
    await scheduler(store).sweep()  # before the removal's own pass (Scheduler.node_removed)
    t_keep, t_again = await store.get_task(keep), await store.get_task(again)
    assert (t_keep.state, t_keep.reason) == ("lost", reasons.NODE_REVOKED)
    assert (t_again.state, t_again.reason) == ("queued", reasons.NODE_REVOKED)
    await scheduler(store).node_removed("n1")  # then the removal's pass finds nothing left to do
    assert (await store.get_task(keep)).state == "lost"


def _patient(store: Store, **counts: int) -> Any:
    """A scheduler whose tick is an hour: its first pass looks at the whole window (for reasons),
    every later one only at what the free room could take. `counts` replace Timing's counts."""
    import dataclasses

    from podium.scheduler.service import Scheduler
    from podium.timing import DEFAULT_TIMING

    return Scheduler(store, dataclasses.replace(DEFAULT_TIMING, tick=3600.0, **counts), server_id="patient")


async def _free_one(store: Store, assigned: tuple[Any, str, int]) -> None:
    from podium.states import AttemptState, TaskState

    tid, node, tok = assigned
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.SUCCEEDED, actor="node", fencing_token=tok,
                                       node_id=node, exit_code=0, end_attempt=AttemptState.EXITED)  # fmt: skip


async def test_a_pass_claims_only_what_the_free_room_could_take(store: Store) -> None:
    """A burst on a full fleet: the pass a freed slot wakes locks one queued row, not the backlog's
    head, and places the oldest task; with no room at all it claims nothing."""
    await add_node(store, "n1", slots=2)
    ids = [await submit(store) for _ in range(30)]
    sched = _patient(store)
    first = await sched.dispatch_once()  # the whole window: every task is told its reason
    assert first.claimed == 30 and [a[0] for a in first.assigned] == ids[:2]
    assert set(first.unplaced) == set(ids[2:]) and set(first.unplaced.values()) == {reasons.FULL}
    nothing = await sched.dispatch_once()
    assert (nothing.claimed, nothing.assigned, nothing.reasons_written) == (0, [], 0)
    await _free_one(store, first.assigned[0])
    one = await sched.dispatch_once()
    assert one.claimed == 1 and [a[0] for a in one.assigned] == [ids[2]]  # the oldest, in claim order
    for tid in ids[3:]:
        assert (await store.get_task(tid)).reason == reasons.FULL  # untouched, still true


async def test_a_pass_with_room_places_up_to_its_limit_and_the_window_look_claims_the_window(store: Store) -> None:
    """Two bounds: a pass claims and places up to `place_limit` tasks while the fleet has room for them
    (on a large fleet with a backlog, fewer and larger passes); the once-a-tick look at the whole
    window claims `claim_limit` rows to tell each its reason, however little room there is."""
    await add_node(store, "n1", slots=12)
    ids = [await submit(store) for _ in range(30)]
    sched = _patient(store, claim_limit=4, place_limit=10)
    first = await sched.dispatch_once()  # the whole window's look, with room for twelve
    assert first.claimed == 10 and [a[0] for a in first.assigned] == ids[:10] and first.unplaced == {}
    second = await sched.dispatch_once()  # what the room could take: two
    assert second.claimed == 2 and [a[0] for a in second.assigned] == ids[10:12]
    assert (await sched.dispatch_once()).claimed == 0  # no room: nothing claimed
    looked = await _patient(store, claim_limit=4, place_limit=10).dispatch_once()  # a tick later: the window
    assert looked.claimed == 4 and looked.assigned == [] and looked.unplaced == {t: reasons.FULL for t in ids[12:16]}
    for tid in ids[16:]:
        assert (await store.get_task(tid)).reason == reasons.WAITING  # beyond the window: not looked at


async def test_a_node_whose_cpu_binds_before_its_slots_is_not_a_reason_to_claim_the_window(store: Store) -> None:
    """Slots set high, CPU the limit (100m a task, 1,050m offered: ten fit, 32 slots): the room a
    pass claims for is counted in tasks the size of those claimed, not in free slots. Counted in
    slots, every freed task made a pass lock and tell the whole backlog (30 rows for one placement).
    A task smaller than every one claimed since waits for the next look at the whole window."""
    await add_node(store, "n1", slots=32, cpu=1050)
    ids = [await submit(store) for _ in range(40)]
    sched = _patient(store)
    first = await sched.dispatch_once()  # the whole window
    assert first.claimed == 40 and [a[0] for a in first.assigned] == ids[:10]
    assert set(first.unplaced.values()) == {reasons.NO_ROOM}
    nothing = await sched.dispatch_once()
    assert (nothing.claimed, nothing.assigned, nothing.reasons_written) == (0, [], 0)
    await _free_one(store, first.assigned[0])
    one = await sched.dispatch_once()
    assert one.claimed == 1 and [a[0] for a in one.assigned] == [ids[10]]
    # 50m are free: a 50m task fits, but no pass woken by freed room counts room for it
    small = await submit(store, resources={"cpu": "50m"})
    assert (await sched.dispatch_once()).claimed == 0
    looked = await _patient(store).dispatch_once()  # a tick later: the whole window
    assert [a[0] for a in looked.assigned] == [small]


async def test_tasks_no_free_node_can_run_do_not_hide_the_ones_behind_them(store: Store) -> None:
    """The claim goes on past tasks the free room cannot serve (a label no node has), in claim order,
    until it finds one it can place: the same placement a look at the whole window makes."""
    await add_node(store, "n1", slots=1)
    busy = await submit(store)
    sched = _patient(store)
    first = await sched.dispatch_once()
    assert [a[0] for a in first.assigned] == [busy]
    picky = [await submit(store, labels={"gpu": "h100"}) for _ in range(9)]
    plain = await submit(store)
    later = [await submit(store) for _ in range(20)]
    await _free_one(store, first.assigned[0])
    out = await sched.dispatch_once()
    assert [a[0] for a in out.assigned] == [plain]
    # chunks of 1, 1, 2, 4, 8 rows: the last also holds six tasks behind, told the truth (full now)
    assert out.claimed == 16
    assert out.unplaced == {t: reasons.NO_LABELS for t in picky} | {t: reasons.FULL for t in later[:6]}
    for tid in later[6:]:
        assert (await store.get_task(tid)).reason == reasons.WAITING  # not looked at yet


async def test_a_task_not_looked_at_is_told_its_reason_within_atick(store: Store) -> None:
    """On a full fleet a new task is not claimed by the passes freed room wakes; the next look at the
    whole window (once a tick; a new scheduler's first pass) tells it why it waits, and writes only
    the reasons that changed."""
    await add_node(store, "n1", slots=1)
    await submit(store)
    sched = _patient(store)
    assert len((await sched.dispatch_once()).assigned) == 1
    waiting = [await submit(store) for _ in range(3)]
    out = await sched.dispatch_once()
    assert out.claimed == 0 and [(await store.get_task(t)).reason for t in waiting] == [reasons.WAITING] * 3
    looked = await _patient(store).dispatch_once()  # a tick later: the whole window
    assert looked.unplaced == {t: reasons.FULL for t in waiting} and looked.reasons_written == 3
    async with store.pool.acquire() as c:
        marks = await c.fetch("SELECT id, xmin::text, updated_at FROM tasks WHERE id = ANY($1) ORDER BY id", waiting)
    again = await _patient(store).dispatch_once()
    assert again.unplaced == looked.unplaced and again.reasons_written == 0
    async with store.pool.acquire() as c:  # no row was written for a reason that did not change
        assert await c.fetch("SELECT id, xmin::text, updated_at FROM tasks WHERE id = ANY($1) ORDER BY id", waiting) == marks


async def test_a_claimed_spec_is_decoded_once_while_it_stays_the_same(store: Store, monkeypatch: Any) -> None:
    """Every look at the whole window claims the same waiting rows again; a spec is decoded the first
    time its text is seen only, and the answers stay those of a fresh decode."""
    import dataclasses
    import json
    import types

    from podium.scheduler import dispatch as dispatch_module
    from podium.scheduler.service import Scheduler
    from podium.timing import DEFAULT_TIMING

    decoded: list[str] = []
    monkeypatch.setattr(dispatch_module, "json", types.SimpleNamespace(loads=lambda s: decoded.append(s) or json.loads(s)))
    await add_node(store, "n1", slots=1, labels={"zone": "a"})
    ids = [await submit(store, command=["true", str(i)]) for i in range(5)]  # five different specs
    eager = Scheduler(store, dataclasses.replace(DEFAULT_TIMING, tick=0.0), server_id="eager")  # always the whole window
    first = await eager.dispatch_once()
    assert [a[0] for a in first.assigned] == ids[:1] and len(decoded) == 5
    second = await eager.dispatch_once()
    assert second.unplaced == first.unplaced == {t: reasons.FULL for t in ids[1:]} and len(decoded) == 5
    elsewhere = await submit(store, labels={"zone": "b"})
    third = await eager.dispatch_once()
    assert third.unplaced[elsewhere] == reasons.NO_LABELS and len(decoded) == 6
    alike = [await submit(store, command=["true", "0"]) for _ in range(3)]  # the same spec as a waiting one
    fourth = await eager.dispatch_once()
    assert {fourth.unplaced[t] for t in alike} == {reasons.FULL} and len(decoded) == 6


async def test_a_pass_that_finds_nothing_queued_builds_no_placer(store: Store) -> None:
    """Indexing every node costs a busy server the most of a pass: a look at the window that claims
    nothing (an idle fleet, once a tick) does not pay it; one that claims a task does."""
    sched = scheduler(store)
    plans: list[Any] = []
    plan = sched.dispatcher.plan

    def keeping(*, whole_window):  # type: ignore[no-untyped-def]
        plans.append(plan(whole_window=whole_window))
        return plans[-1]

    sched.dispatcher.plan = keeping  # type: ignore[method-assign]
    await add_node(store, "n1", slots=1)
    idle = await sched.dispatch_once()
    assert (idle.claimed, idle.assigned) == (0, []) and plans[-1].whole_window and plans[-1]._placer is None
    tid = await submit(store)
    busy = await sched.dispatch_once()
    assert [a[0] for a in busy.assigned] == [tid] and plans[-1]._placer is not None


async def test_a_pass_that_leaves_the_fleet_full_lets_the_next_wait_a_moment(store: Store) -> None:
    """On a full fleet each group commit of ends wakes the dispatcher; a pass that leaves no room asks
    its loop to start the next no sooner than SETTLE_WHEN_FULL, so that it places several commits'
    ends at once. A pass that leaves room asks nothing: a task submitted to it is placed at once."""
    from podium.scheduler.dispatch import SETTLE_WHEN_FULL

    await add_node(store, "n1", slots=2)
    ids = [await submit(store) for _ in range(3)]
    d = _patient(store).dispatcher
    settled: list[float] = []
    d.loop.settle = settled.append  # type: ignore[method-assign]
    assert await d.loop.run_pass() is None  # at the next wake-up
    assert settled == [SETTLE_WHEN_FULL]
    placed = await store.get_task(ids[0])
    assert placed.state == "assigned" and (await store.get_task(ids[2])).state == "queued"
    # a freed slot: the pass places the queued task, and the fleet is full again
    async with store.pool.acquire() as c:
        tok = await c.fetchval("SELECT fencing_token FROM tasks WHERE id = $1", ids[0])
    await _free_one(store, (ids[0], "n1", tok))
    assert await d.loop.run_pass() is None
    assert (await store.get_task(ids[2])).state == "assigned"
    assert settled == [SETTLE_WHEN_FULL] * 2
    # room: a node of ten slots joins, a task is placed on it, and nine slots are left
    await add_node(store, "n2", slots=10)
    late = await submit(store)
    assert await d.loop.run_pass() is None
    assert (await store.get_task(late)).node_id == "n2"
    assert settled == [SETTLE_WHEN_FULL] * 2  # not asked again


async def test_a_settled_loop_starts_its_next_pass_no_sooner_than_asked(store: Store) -> None:
    """`WokenLoop.settle`: woken at once (a NOTIFY sent as the first pass ends), the next pass still
    starts no sooner than the time asked for, and the wake-up heard meanwhile is not lost. A poke (a
    submission handed to the idle dispatcher, whose HTTP answer waits for the pass) is not held."""
    from podium.scheduler.woken import WokenLoop

    loop = asyncio.get_running_loop()
    starts: list[float] = []
    asked: list[float] = []
    passes = [asyncio.Event() for _ in range(3)]

    async def run_pass() -> float | None:
        starts.append(loop.time())
        if len(starts) == 1:
            asked.append(loop.time())
            woken.settle(0.3)
            async with store.pool.acquire() as c:
                await c.execute("SELECT pg_notify('podium_test_settle', '')")
        elif len(starts) == 2:
            woken.settle(3600.0)  # as long as the tick: only the poke below brings the third pass
        passes[len(starts) - 1].set()
        return None

    woken = WokenLoop("test", store, "podium_test_settle", 3600.0, run_pass)
    task = asyncio.create_task(woken.run())
    try:
        await asyncio.wait_for(passes[1].wait(), 30)
        while not woken.idle and not task.done():  # waiting for a wake-up (a loop that failed: see below)
            await asyncio.sleep(0.01)
        assert not task.done(), task
        woken.poke()
        await asyncio.wait_for(passes[2].wait(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await woken.close()
    # the loop's clock, which its timers may run ahead of by its resolution
    assert starts[1] - asked[0] >= 0.3 - loop._clock_resolution


async def test_a_pass_retried_after_a_refusal_places_on_the_nodes_as_they_are_not_on_its_first_tries_reservations(
    store: Store,
) -> None:
    """PostgreSQL refuses a pass's transaction (a deadlock, a serialization failure) after its placer
    reserved the only slot for the task: the whole pass runs again, on the same plan. The retry
    places on the nodes as they are (the slot free: nothing of the first try was written), not on what
    the rolled-back try reserved in its placer, which left the task queued as if the node were full."""
    import asyncpg

    await add_node(store, "n1", slots=1)
    sched = scheduler(store)
    d = sched.dispatcher
    tid = await submit(store)
    refused: list[int] = []
    plan_of = d.plan

    def plan(*, whole_window: bool) -> Any:
        p = plan_of(whole_window=whole_window)
        place = p.place

        def refused_once(tasks: Any) -> Any:
            out = place(tasks)
            if not refused:
                refused.append(len(out[0]))
                raise asyncpg.exceptions.DeadlockDetectedError("the first try is refused (injected)")
            return out

        p.place = refused_once  # type: ignore[method-assign]
        return p

    d.plan = plan  # type: ignore[method-assign]
    out = await sched.dispatch_once()
    assert refused == [1], "the first try placed the task, then was refused"
    assert out.unplaced == {} and [(t, n) for t, n, _tok in out.assigned] == [(tid, "n1")]
    t = await store.get_task(tid)
    assert (t.state, t.node_id, t.attempts) == ("assigned", "n1", 1)
