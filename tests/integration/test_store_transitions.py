"""The state machine, against real PostgreSQL (embedded and 15): every allowed transition goes
through; a wrong `from`, a stale fencing token or another node's claim changes nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from podium import reasons
from podium.states import ALLOWED, AttemptState, TaskState
from podium.store import Store
from tests.integration.helpers import add_node, node_row, place, running_on_n1, submit

S = TaskState


async def snapshot(store: Store, tid: object) -> tuple:
    async with store.pool.acquire() as c:
        task = await c.fetchrow("SELECT * FROM tasks WHERE id = $1", tid)
        attempts = await c.fetch("SELECT * FROM attempts WHERE task_id = $1 ORDER BY attempt", tid)
        events = await c.fetch("SELECT * FROM task_events WHERE task_id = $1 ORDER BY id", tid)
        nodes = await c.fetch("SELECT * FROM nodes ORDER BY id")
    return dict(task), [dict(a) for a in attempts], [dict(e) for e in events], [dict(n) for n in nodes]


async def placed_on_two_nodes(store: Store, n: int) -> tuple[list[Any], dict[Any, tuple[str, int]]]:
    """`n` tasks submitted and placed on two nodes of 4 slots each: their ids, and each one's (node, token)."""
    await add_node(store, "n1", slots=4)
    await add_node(store, "n2", slots=4)
    ids = [await submit(store) for _ in range(n)]
    out = await place(store)
    where = {tid: (node, tok) for tid, node, tok in out.assigned}
    assert set(where) == set(ids)
    return ids, where


async def to_state(store: Store, target: TaskState) -> tuple[object, int | None]:
    """A task brought to `target` through legal transitions; returns (id, fencing token)."""
    await add_node(store)
    tid = await submit(store)
    if target == S.QUEUED:
        return tid, None
    out = await place(store)
    assert len(out.assigned) == 1
    tok = out.assigned[0][2]
    path = {
        S.ASSIGNED: [],
        S.PROVISIONING: [(S.ASSIGNED, S.PROVISIONING)],
        S.RUNNING: [(S.ASSIGNED, S.RUNNING)],
        S.CANCELLING: [(S.ASSIGNED, S.RUNNING), (S.RUNNING, S.CANCELLING)],
    }[target]
    for a, b in path:
        assert await store.transition_task(tid, a, b, actor="test", fencing_token=tok, node_id="n1")
    return tid, tok


@pytest.mark.parametrize("from_,to", sorted(ALLOWED))
async def test_every_allowed_transition(store: Store, from_: TaskState, to: TaskState) -> None:
    tid, tok = await to_state(store, from_)
    ends = to in (S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.LOST) and from_ != S.QUEUED
    result = await store.transition_task(
        tid, from_, to, actor="test", reason="because", fencing_token=tok,
        end_attempt=AttemptState.EXITED if ends else None,
    )  # fmt: skip
    assert result is not None
    task, attempts, events, nodes = await snapshot(store, tid)
    assert task["state"] == to
    assert (events[-1]["from_state"], events[-1]["to_state"], events[-1]["reason"]) == (from_, to, "because")
    if ends:
        # the attempt is closed and its capacity given back, exactly
        assert attempts[-1]["released"] and attempts[-1]["finished_at"] is not None
        assert task["node_id"] is None
        assert nodes[0]["res_slots"] == 0 and nodes[0]["res_cpu_millis"] == 0 and nodes[0]["res_memory_bytes"] == 0


@pytest.mark.parametrize("actual", [S.QUEUED, S.ASSIGNED, S.RUNNING])
async def test_wrong_from_changes_nothing(store: Store, actual: TaskState) -> None:
    tid, tok = await to_state(store, actual)
    before = await snapshot(store, tid)
    wrong = S.PROVISIONING if actual != S.PROVISIONING else S.ASSIGNED
    assert await store.transition_task(tid, wrong, S.RUNNING, actor="test") is None
    assert await store.transition_task(tid, S.CANCELLING, S.CANCELLED, actor="test") is None
    assert await snapshot(store, tid) == before


async def test_stale_fencing_token_and_foreign_node_change_nothing(store: Store) -> None:
    tid, tok = await to_state(store, S.RUNNING)
    assert tok is not None
    await add_node(store, "n2")
    before = await snapshot(store, tid)
    assert await store.transition_task(tid, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=tok - 1,
                                       end_attempt=AttemptState.EXITED, exit_code=0) is None  # fmt: skip
    assert await store.transition_task(tid, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=tok, node_id="n2",
                                       end_attempt=AttemptState.EXITED, exit_code=0) is None  # fmt: skip
    after = await snapshot(store, tid)
    assert after[:3] == before[:3]
    # the right node with the right token goes through, once
    assert await store.transition_task(tid, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=tok, node_id="n1",
                                       end_attempt=AttemptState.EXITED, exit_code=0)  # fmt: skip
    assert await store.transition_task(tid, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=tok, node_id="n1",
                                       end_attempt=AttemptState.EXITED, exit_code=0) is None  # fmt: skip


async def test_disallowed_transition_is_refused_before_touching_the_database(store: Store) -> None:
    tid, _ = await to_state(store, S.QUEUED)
    with pytest.raises(ValueError, match="not allowed"):
        await store.transition_task(tid, S.SUCCEEDED, S.RUNNING, actor="test")


async def test_capacity_is_freed_exactly_once_when_two_enders_race(store: Store) -> None:
    import asyncio

    tid, tok = await to_state(store, S.RUNNING)
    assert (await node_row(store, "n1"))["res_slots"] == 1
    results = await asyncio.gather(
        store.transition_task(tid, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=tok, end_attempt=AttemptState.EXITED, exit_code=0),
        store.transition_task(tid, S.RUNNING, S.QUEUED, actor="watchdog", reason=reasons.NODE_LOST, end_attempt=AttemptState.LOST),
    )
    assert sum(r is not None for r in results) == 1
    n = await node_row(store, "n1")
    assert n["res_slots"] == 0 and n["res_cpu_millis"] == 0


async def test_idempotency_key_returns_the_same_task(store: Store) -> None:
    from podium.errors import Conflict
    from podium.spec import TaskSpec

    a, created_a = await store.submit(TaskSpec(command=["true"]), idempotency_key="k")
    b, created_b = await store.submit(TaskSpec(command=["true"]), idempotency_key="k")
    assert (created_a, created_b) == (True, False) and a.id == b.id
    with pytest.raises(Conflict, match="different spec"):
        await store.submit(TaskSpec(command=["false"]), idempotency_key="k")
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM tasks") == 1


async def test_a_batch_is_stored_whole_or_not_at_all(store: Store) -> None:
    from podium.errors import Conflict
    from podium.spec import TaskSpec

    first, _ = await store.submit(TaskSpec(command=["true"]), idempotency_key="k1")
    out = await store.submit_many(
        [(TaskSpec(command=["true"]), "k1"), (TaskSpec(command=["echo", "a"]), "k2"), (TaskSpec(command=["echo", "b"]), None)],
        actor="test",
    )
    assert [created for _r, created in out] == [False, True, True]
    assert out[0][0].id == first.id
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM tasks") == 3
        assert await c.fetchval("SELECT count(*) FROM task_events") == 3
        assert await c.fetchval("SELECT count(*) FROM audit_log WHERE action = 'task.submit'") == 3
    with pytest.raises(Conflict):
        await store.submit_many([(TaskSpec(command=["echo", "c"]), "k3"), (TaskSpec(command=["false"]), "k2")], actor="test")
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM tasks") == 3  # nothing of the refused batch


async def test_a_change_and_its_audit_entry_are_written_together_or_not_at_all(store: Store) -> None:
    """An audit entry given with a change is in the change's transaction: written only when the change
    is made, and an entry that cannot be written takes the change back with it."""
    from podium.store import AuditEntry, Change

    tid, tok = await to_state(store, S.ASSIGNED)

    async def entries() -> list[tuple[str, str, str]]:
        async with store.pool.acquire() as c:
            rows = await c.fetch("SELECT actor, action, target FROM audit_log WHERE action = 'task.test' ORDER BY id")
        return [tuple(r) for r in rows]

    failed = Change(tid, S.ASSIGNED, S.FAILED, actor="gateway:x", reason="why", fencing_token=tok,
                    end_attempt=AttemptState.REVOKED)  # fmt: skip
    # a detail the database cannot store (not JSON): the failure is not written either
    with pytest.raises(Exception, match="not JSON serializable"):
        await store.transition(failed, audit=AuditEntry("task.test", {"secret": object()}))
    task, attempts, events, _ = await snapshot(store, tid)
    assert (task["state"], [a["state"] for a in attempts], events[-1]["to_state"]) == (S.ASSIGNED, ["assigned"], S.ASSIGNED)
    assert await entries() == []
    # a refused compare-and-set (a stale token) writes no entry
    stale = dataclasses.replace(failed, fencing_token=tok + 1)
    assert await store.transition(stale, audit=AuditEntry("task.test", {"n": 1})) is None
    assert await entries() == []
    # the change made: its entry, by its actor, about its task
    assert await store.transition(failed, audit=AuditEntry("task.test", {"n": 2})) is not None
    assert (await store.get_task(tid)).state == S.FAILED
    assert await entries() == [("gateway:x", "task.test", str(tid))]


async def test_a_group_commit_gives_each_change_the_answer_it_would_get_alone(store: Store) -> None:
    """transition_many: several compare-and-sets in one commit. A wrong `from`, a stale token or a
    foreign node refuses that change only; the accepted ones free capacity exactly as alone."""
    from podium.store import Change

    ids, where = await placed_on_two_nodes(store, 4)
    a, b, c, d = ids
    changes = [
        Change(a, S.ASSIGNED, S.SUCCEEDED, actor="node", fencing_token=where[a][1], node_id=where[a][0],
               exit_code=0, end_attempt=AttemptState.EXITED),
        Change(b, S.RUNNING, S.SUCCEEDED, actor="node", fencing_token=where[b][1], node_id=where[b][0],
               end_attempt=AttemptState.EXITED),  # wrong from: b is assigned
        Change(c, S.ASSIGNED, S.PROVISIONING, actor="node", fencing_token=where[c][1] + 1000, node_id=where[c][0],
               attempt_state=AttemptState.PROVISIONING),  # a stale token
        Change(d, S.ASSIGNED, S.PROVISIONING, actor="node", fencing_token=where[d][1], node_id="nobody",
               attempt_state=AttemptState.PROVISIONING),  # a foreign node
    ]  # fmt: skip
    results = await store.transition_many(changes)
    assert [r is not None for r in results] == [True, False, False, False]
    assert results[0].task_id == a
    assert [(await store.get_task(t)).state for t in ids] == ["succeeded", "assigned", "assigned", "assigned"]
    reserved = sum([(await node_row(store, n))["res_slots"] for n in ("n1", "n2")])
    assert reserved == 3  # a's slot freed once, the others still held
    with pytest.raises(ValueError, match="not allowed"):
        await store.transition_many([changes[2], Change(b, S.SUCCEEDED, S.RUNNING, actor="x")])
    assert [(await store.get_task(t)).state for t in (b, c)] == ["assigned", "assigned"]  # a refused batch touched nothing
    # several attempts on one node ending in one statement free all of their capacity
    rest = [Change(t, S.ASSIGNED, S.LOST, actor="watchdog", reason=reasons.NODE_LOST, end_attempt=AttemptState.LOST)
            for t in (b, c, d)]  # fmt: skip
    assert all(await store.transition_many(rest))
    assert [(await node_row(store, n))["res_slots"] for n in ("n1", "n2")] == [0, 0]
    assert [(await node_row(store, n))["res_cpu_millis"] for n in ("n1", "n2")] == [0, 0]
    _, attempts, events = await store.task_detail(c)
    assert [a.state for a in attempts] == ["lost"] and attempts[0].released
    assert [(e.from_state, e.to_state, e.reason) for e in events][-1] == ("assigned", "lost", reasons.NODE_LOST)


async def test_a_group_commit_makes_several_changes_of_one_task_in_order(store: Store) -> None:
    """A node's `running` and its end read in one batch: each change of a task from the state the one
    before it left, all in one commit (one transaction id); a later change of a task whose earlier one
    was refused is not made, and the other tasks' changes are."""
    from podium.store import Change

    await add_node(store, "n1", slots=4)
    a, b, c = [await submit(store) for _ in range(3)]
    out = await place(store)
    tok = {tid: t for tid, _node, t in out.assigned}
    for tid in (a, b, c):
        assert await store.transition_task(tid, S.ASSIGNED, S.PROVISIONING, actor="t", fencing_token=tok[tid],
                                           node_id="n1", attempt_state=AttemptState.PROVISIONING)  # fmt: skip

    def running(t: object, token: int) -> Change:
        return Change(t, S.PROVISIONING, S.RUNNING, actor="node:n1", fencing_token=token, node_id="n1",
                      attempt_state=AttemptState.RUNNING, lease_seconds=-1)  # fmt: skip

    def exited(t: object, token: int, code: int) -> Change:
        to = S.SUCCEEDED if code == 0 else S.FAILED
        return Change(t, S.RUNNING, to, actor="node:n1", fencing_token=token, node_id="n1", exit_code=code,
                      end_attempt=AttemptState.EXITED, reason=None if code == 0 else reasons.EXITED_NONZERO)  # fmt: skip

    # b's running carries a stale token: refused, so its end is not tried either
    changes = [running(a, tok[a]), running(b, tok[b] + 7), running(c, tok[c]), exited(a, tok[a], 0),
               exited(b, tok[b], 0), exited(c, tok[c], 3)]  # fmt: skip
    results = await store.transition_many(changes)
    assert [r is not None for r in results] == [True, False, True, True, False, True]
    assert [(await store.get_task(t)).state for t in (a, b, c)] == ["succeeded", "provisioning", "failed"]
    for t, end in ((a, "succeeded"), (c, "failed")):
        task, attempts, events, _nodes = await snapshot(store, t)
        assert [(e["from_state"], e["to_state"]) for e in events][-2:] == [("provisioning", "running"), ("running", end)]
        assert events[-1]["id"] > events[-2]["id"]  # the event stream keeps their order
        assert attempts[-1]["started_at"] is not None and attempts[-1]["finished_at"] is not None
        assert attempts[-1]["released"] and task["node_id"] is None
    async with store.pool.acquire() as conn:
        txids = await conn.fetch("SELECT DISTINCT xmin::text FROM tasks WHERE id = ANY($1::uuid[])", [a, c])
    assert len(txids) == 1  # one transaction, one commit
    assert (await node_row(store, "n1"))["res_slots"] == 1  # a's and c's slots freed once each; b's held


async def test_a_change_through_running_records_the_start_and_the_end_in_one_write(store: Store) -> None:
    """A `running` and the end read with it, as one change (`via`): the task row is written once (one
    revision), and both events, the attempt's start, its end and its backend reference are recorded as
    two changes would have recorded them. Another via, or a via that is no end, is refused before the
    database is touched."""
    from podium.store import Change

    tid, tok = await to_state(store, S.PROVISIONING)
    before, _attempts, _events, _nodes = await snapshot(store, tid)
    through = Change(tid, S.PROVISIONING, S.FAILED, actor="node:n1", fencing_token=tok, node_id="n1", exit_code=3,
                     end_attempt=AttemptState.EXITED, reason=reasons.EXITED_NONZERO, failure_class="exit",
                     backend_ref="4242", via=S.RUNNING)  # fmt: skip
    for wrong in (
        dataclasses.replace(through, via=S.CANCELLING),
        dataclasses.replace(through, to=S.RUNNING, end_attempt=None, attempt_state=AttemptState.RUNNING),
        dataclasses.replace(through, from_=S.QUEUED),
    ):
        with pytest.raises(ValueError):
            await store.transition(wrong)
    assert (await snapshot(store, tid))[0] == before
    assert await store.transition(through) is not None
    task, attempts, events, nodes = await snapshot(store, tid)
    assert (task["state"], task["exit_code"], task["revision"]) == ("failed", 3, before["revision"] + 1)
    assert [(e["from_state"], e["to_state"], e["reason"], e["failure_class"]) for e in events][-2:] == [
        ("provisioning", "running", None, None), ("running", "failed", reasons.EXITED_NONZERO, "exit")
    ]  # fmt: skip
    assert events[-1]["id"] > events[-2]["id"]  # the event stream keeps their order
    a = attempts[-1]
    assert (a["state"], a["exit_code"], a["backend_ref"], a["released"]) == ("exited", 3, "4242", True)
    assert a["started_at"] is not None and a["finished_at"] >= a["started_at"]
    assert task["node_id"] is None and nodes[0]["res_slots"] == 0
    # the same change again is refused like any stale one: nothing is written twice
    assert await store.transition(through) is None


async def test_changes_made_as_expected_are_each_their_own_compare_and_set(store: Store) -> None:
    """transition_expected: changes decided on what the rows are expected to hold, with no read, in one
    statement. A row as expected takes its change exactly as a read-and-decide would make it; a row
    holding anything else (another state, token or node) refuses it and is left untouched, events
    and revision included. A change that frees capacity, or two of one task, is refused before the
    database is touched."""
    from podium.store import Change

    ids, where = await placed_on_two_nodes(store, 5)
    a, b, c, d, e = ids
    assert await store.transition_task(e, S.ASSIGNED, S.CANCELLING, actor="operator", reason=reasons.CANCELLED)

    def accept(t: object, token: int, node: str) -> Change:
        return Change(t, S.ASSIGNED, S.PROVISIONING, actor=f"node:{node}", fencing_token=token, node_id=node,
                      attempt_state=AttemptState.PROVISIONING, lease_seconds=60.0)  # fmt: skip

    before = {t: await snapshot(store, t) for t in ids}
    changes = [
        accept(d, where[d][1], where[d][0]),
        accept(a, where[a][1], where[a][0]),
        accept(b, where[b][1] + 1000, where[b][0]),  # a token the task never had
        accept(c, where[c][1], "nobody"),  # another node's word
        accept(e, where[e][1], where[e][0]),  # no longer assigned: cancelled meanwhile
    ]
    results = await store.transition_expected(changes)
    assert [r is not None for r in results] == [True, True, False, False, False]
    assert [(r.task_id, r.fencing_token) for r in results[:2] if r] == [(d, where[d][1]), (a, where[a][1])]
    for t in (a, d):
        task, attempts, events, _nodes = await snapshot(store, t)
        assert (task["state"], task["revision"]) == ("provisioning", before[t][0]["revision"] + 1)
        assert task["lease_expires_at"] is not None
        assert (attempts[-1]["state"], attempts[-1]["provisioning_at"] is not None) == ("provisioning", True)
        assert (attempts[-1]["node_id"], attempts[-1]["fencing_token"]) == where[t]
        assert [(ev["from_state"], ev["to_state"], ev["actor"]) for ev in events][-1] == (
            "assigned", "provisioning", f"node:{where[t][0]}"
        )  # fmt: skip
    for t in (b, c, e):
        assert (await snapshot(store, t))[:3] == before[t][:3]  # refused: not a byte of it written
    # made once: the same again is refused like any stale change
    assert await store.transition_expected(changes[:2]) == [None, None]
    with pytest.raises(ValueError, match="capacity"):
        await store.transition_expected([Change(b, S.ASSIGNED, S.SUCCEEDED, actor="node", fencing_token=where[b][1],
                                                node_id=where[b][0], exit_code=0, end_attempt=AttemptState.EXITED)])  # fmt: skip
    with pytest.raises(ValueError, match="one change per task"):
        await store.transition_expected([accept(b, where[b][1], where[b][0])] * 2)
    assert (await snapshot(store, b))[:3] == before[b][:3]
    assert await store.transition_expected([]) == []


async def test_a_decided_group_commit_reads_under_the_locks_it_writes_under(store: Store) -> None:
    """transition_decided: the tasks are locked by the statement that reads them, so a change elsewhere
    either commits before the read (and is what `decide` sees) or waits for the commit; their nodes
    are locked only for an end (by that statement for the tasks the caller says report one, else
    before the first write); `decide` may change only tasks it was given."""
    import asyncio

    import asyncpg

    from podium.store import Change

    await add_node(store, "n1", slots=4)
    a, b = await submit(store), await submit(store)
    out = await place(store)
    tok = {tid: t for tid, _node, t in out.assigned}
    seen: list[str] = []

    def provisioning(rows: Any) -> list[Change]:
        seen.append(rows[a].state)
        if rows[a].state != S.ASSIGNED:
            return []
        return [Change(a, S.ASSIGNED, S.PROVISIONING, actor="node:n1", fencing_token=tok[a], node_id="n1",
                       attempt_state=AttemptState.PROVISIONING)]  # fmt: skip

    async with store.pool.acquire() as other:
        tr = other.transaction()
        await tr.start()
        # another writer holds the task and moves it; the group commit waits for it, then reads its result
        await other.execute("SELECT 1 FROM tasks WHERE id = $1 FOR NO KEY UPDATE", a)
        pending = asyncio.ensure_future(store.transition_decided([a], provisioning))
        await asyncio.sleep(0.3)
        assert not pending.done() and seen == []  # nothing read before the lock was had
        await other.execute("UPDATE tasks SET state = 'cancelling' WHERE id = $1", a)
        await tr.commit()
        changes, results = await pending
    assert seen == ["cancelling"] and changes == [] and results == []

    # while the read's transaction is open, the task is locked against other writers, and its node
    # only when the task reports an end (a heartbeat flush or a placement waits only for a batch that
    # may free that node)
    for ending, node_locked in (([], False), ([b], True)):
        async with store.pool.acquire() as mine, mine.transaction():
            assert [r["id"] for r in await mine.fetch(store.q["lock_task_facts"], [b], ending)] == [b]
            async with store.pool.acquire() as other:
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await other.execute("SELECT 1 FROM tasks WHERE id = $1 FOR NO KEY UPDATE NOWAIT", b)
                async with other.transaction():
                    node = other.execute("SELECT 1 FROM nodes WHERE id = $1 FOR NO KEY UPDATE NOWAIT", "n1")
                    if node_locked:
                        with pytest.raises(asyncpg.LockNotAvailableError):
                            await node
                    else:
                        await node

    # an end the caller did not announce still frees its node's capacity, once: the node is locked
    # before the write
    held = (await node_row(store, "n1"))["res_slots"]

    def ended(rows: Any) -> list[Change]:
        return [Change(b, S.ASSIGNED, S.FAILED, actor="node:n1", fencing_token=tok[b], node_id="n1",
                       end_attempt=AttemptState.FAILED, reason=reasons.RETRYABLE_ERROR)]  # fmt: skip

    _changes, results = await store.transition_decided([b], ended)
    assert results[0] is not None and (await node_row(store, "n1"))["res_slots"] == held - 1

    def stray(rows: Any) -> list[Change]:
        return [Change(a, S.CANCELLING, S.CANCELLED, actor="x", end_attempt=AttemptState.STOPPED)]

    with pytest.raises(ValueError, match="not read and locked"):
        await store.transition_decided([b], stray)
    assert (await store.get_task(a)).state == "cancelling"  # the refused batch wrote nothing


async def test_a_queued_tasks_reason_is_written_without_touching_an_index(store: Store) -> None:
    """A task row is written several times on its way; a write that changes no indexed column (the
    reason a queued task waits) is a HOT update, even on a page filled by a batch of submissions
    (issue 17: index writes per task)."""
    from podium.spec import TaskSpec

    rows = await store.submit_many([(TaskSpec(command=["true"], name="x"), None) for _ in range(200)], actor="test")
    first = rows[0][0].id  # on the first page, which the batch filled
    async with store.pool.acquire() as c, c.transaction():
        assert await c.fetchval("SELECT (ctid::text::point)[0] FROM tasks WHERE id = $1", first) == 0
        assert await c.fetchval("SELECT count(*) FROM tasks WHERE (ctid::text::point)[0] = 0") > 5
        await c.execute(store.q["set_queued_reasons"], [first], [reasons.FULL])
        assert await c.fetchval("SELECT pg_stat_get_xact_tuples_hot_updated('tasks'::regclass)") == 1
        assert await c.fetchval("SELECT pg_stat_get_xact_tuples_updated('tasks'::regclass)") == 1
    assert (await store.get_task(first)).reason == reasons.FULL


async def test_output_given_with_a_batch_of_ends_is_committed_with_them_or_not_at_all(store: Store) -> None:
    """transition_decided's `logs`: the chunks a node sent before its end are stored in the end's own
    transaction — a batch refused as a whole stores none of them, one made stores them with its ends."""
    from podium.store import Change

    tid, tok = await running_on_n1(store, command=["echo", "hi"])
    logs = [(tid, tok, "stdout", 0, 0, b"hi\n", "n1")]

    async def stored() -> int:
        async with store.pool.acquire() as c:
            return int(await c.fetchval("SELECT count(*) FROM log_chunks WHERE task_id = $1", tid))

    def broken(rows: Any) -> list[Change]:
        raise RuntimeError("a decision that fails after the chunks were written")

    with pytest.raises(RuntimeError):
        await store.transition_decided([tid], broken, ending=[tid], logs=logs)
    assert await stored() == 0 and (await store.get_task(tid)).state == S.RUNNING

    def ended(rows: Any) -> list[Change]:
        return [Change(tid, S.RUNNING, S.SUCCEEDED, actor="node:n1", fencing_token=tok, node_id="n1",
                       end_attempt=AttemptState.EXITED, exit_code=0)]  # fmt: skip

    _changes, results = await store.transition_decided([tid], ended, ending=[tid], logs=logs)
    assert results[0] is not None and await stored() == 1 and (await store.get_task(tid)).state == S.SUCCEEDED
