"""A pass's submission stored by its first claim, in one statement (`insert_tasks_claiming`): the tasks
stored exactly as insert_tasks stores them, merged into the claim of the queue in claim order and cut
to the claim's limit, the marker of a held task said as claim_queued says it, and a task the claim
does not take (past the limit, an image still to resolve) left queued for the next. Real PostgreSQL."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from podium import reasons
from podium.errors import StoreUnavailable
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.db import Submissions
from podium.store.queries import queries
from podium.store.rows import TaskRow
from tests.integration.helpers import submit, until


def _subs(store: Store, *specs: TaskSpec) -> Submissions:
    return store.submissions([(s, None) for s in specs], actor="op")


@asynccontextmanager
async def _tx(store: Store) -> AsyncIterator[asyncpg.Connection]:
    async with store.pool.acquire() as c, c.transaction():
        yield c


async def _claim_storing(c: asyncpg.Connection, sub: Submissions, limit: int) -> tuple[list[Any], list[TaskRow], list[Any]]:
    """The claimed rows (in the order returned), the tasks stored, and the marker row (if any)."""
    got = await c.fetch(queries()["insert_tasks_claiming"], limit, [], [], [], sub.rows, reasons.WAITING, sub.actor)
    claimed = [r for r in got if r["held"] is False]
    marker = [r for r in got if r["held"] is True]
    stored = TaskRow.many([r["stored"] for r in got if r["held"] is None])
    # claimed rows first, the marker after them, the stored tasks last
    assert [r["held"] for r in got] == [False] * len(claimed) + [True] * len(marker) + [None] * len(stored)
    return claimed, stored, marker


async def _written(store: Store, tid: uuid.UUID) -> tuple[Any, ...]:
    async with store.pool.acquire() as c:
        events = await c.fetch("SELECT from_state, to_state, reason, actor, fencing_token FROM task_events "
                               "WHERE task_id = $1 ORDER BY id", tid)  # fmt: skip
        audit = await c.fetch("SELECT actor, action, detail FROM audit_log WHERE target = $1 ORDER BY id", str(tid))
    return [tuple(e) for e in events], [tuple(a) for a in audit]


def _as_stored(row: TaskRow) -> dict[str, Any]:
    """A task row without what differs between two submissions of the same spec."""
    d = dataclasses.asdict(row)
    for k in ("id", "created_at", "updated_at"):
        d.pop(k)
    return d


async def test_tasks_stored_by_a_claim_are_stored_as_insert_tasks_stores_them(store: Store) -> None:
    spec = TaskSpec(command=["sh", "-c", "echo hi"], name="twins", priority=3, env={"A": "1"}, labels={"k": "v"})
    [(plain, _)] = await store.submit_many([(spec, None)], actor="op")
    async with _tx(store) as c:
        claimed, [stored], _marker = await _claim_storing(c, _subs(store, spec), 10)
    assert [r["id"] for r in claimed] == [plain.id, stored.id], "both queued, in claim order (the older first)"
    # the row it answers with is the row stored, and the row insert_tasks stores for the same spec
    assert stored == await store.get_task(stored.id)
    assert _as_stored(stored) == _as_stored(plain)
    assert await _written(store, stored.id) == await _written(store, plain.id)
    # and a claimed new task reads as the claim reads a stored one
    by_id = {r["id"]: r for r in claimed}
    async with _tx(store) as c:
        again = {r["id"]: r for r in await c.fetch(queries()["claim_queued"], 10, [], [], [])}
    for tid in (plain.id, stored.id):
        mine = {k: v for k, v in by_id[tid].items() if k not in ("stored", "notified")}
        assert mine | {"locked": 0} == dict(again[tid]) | {"locked": 0}


async def test_new_tasks_are_merged_into_claim_order_and_cut_to_the_limit(store: Store) -> None:
    high = await submit(store, priority=10)
    low = await submit(store, priority=0)
    sub = _subs(store, TaskSpec(command=["true"], priority=5), TaskSpec(command=["true"], priority=0))
    mid, last = sub.ids
    async with _tx(store) as c:
        claimed, stored, marker = await _claim_storing(c, sub, 3)
        assert [r["id"] for r in claimed] == [high, mid, low], "priority, then age: the new ones are the newest"
        assert marker == [] and {t.id for t in stored} == {mid, last}
        # the one past the limit is stored, queued, and the pass's next claim takes it
        nxt = await c.fetch(queries()["claim_queued"], 3, [high, mid, low], [], [])
        assert [r["id"] for r in nxt if not r["held"]] == [last]
    assert (await store.get_task(last)).state == "queued"


async def test_a_short_claim_that_stores_says_it_passed_over_a_held_task(store: Store) -> None:
    held = await submit(store)
    sub = _subs(store, TaskSpec(command=["true"]))
    async with store.pool.acquire() as other, other.transaction():
        await other.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", held)
        async with _tx(store) as c:
            claimed, _stored, marker = await _claim_storing(c, sub, 10)
    assert [r["id"] for r in claimed] == list(sub.ids), "the held task is skipped, not waited for"
    assert len(marker) == 1 and marker[0]["id"] is None
    # and with nothing held, no marker
    async with _tx(store) as c:
        claimed, _stored, marker = await _claim_storing(c, _subs(store, TaskSpec(command=["true"])), 10)
    assert len(claimed) == 3 and marker == []


async def test_a_task_with_an_image_to_resolve_is_stored_not_claimed_and_wakes_the_resolver(store: Store) -> None:
    sub = _subs(store, TaskSpec(backend="container", image="registry.test/app:1", command=["true"]), TaskSpec(command=["true"]))
    boxed, plain = sub.ids
    heard: list[str] = []

    def note(_conn: Any, _pid: int, channel: str, _payload: str) -> None:
        heard.append(channel)

    async with store.pool.acquire() as listener:
        await listener.add_listener("podium_resolve", note)
        async with _tx(store) as c:
            got = await c.fetch(queries()["insert_tasks_claiming"], 10, [], [], [], sub.rows, reasons.WAITING, "op")
        claimed = [r["id"] for r in got if r["held"] is False]
        stored = {r["stored"]["id"]: r["notified"] for r in got if r["held"] is None}
        assert claimed == [plain] and set(stored) == {boxed, plain}
        assert set(stored.values()) == {1}, "the resolver's NOTIFY sent"
        try:
            await until(lambda: bool(heard), "the resolver's NOTIFY heard")
        finally:
            await listener.remove_listener("podium_resolve", note)
        assert heard == ["podium_resolve"]
    t = await store.get_task(boxed)
    assert (t.state, t.image, t.image_digest) == ("queued", "registry.test/app:1", None)


async def test_a_row_type_a_migration_changed_is_read_again_after_one_failed_operation(db_url: str) -> None:
    """A newer replica's migration adds a column to `tasks` while this server has the row's type in
    its driver's cache: the next statement that returns a whole row fails as if its connection were
    lost (nothing written; asyncpg drops its cached types then), and the one after reads the row."""
    store = await Store.connect(db_url, min_size=1, max_size=1)
    try:

        async def claim_storing() -> list[TaskRow]:
            async with store._conn() as c, c.transaction():
                return (await _claim_storing(c, _subs(store, TaskSpec(command=["true"])), 10))[1]

        await claim_storing()
        async with store.pool.acquire() as c:
            await c.execute("ALTER TABLE tasks ADD COLUMN added_later int")
        with pytest.raises(StoreUnavailable):
            await claim_storing()
        [stored] = await claim_storing()
        assert (await store.get_task(stored.id)).state == "queued"
        async with store.pool.acquire() as c:
            assert await c.fetchval("SELECT count(*) FROM tasks") == 2, "the failed one stored nothing"
    finally:
        await store.close()


class _Watching:
    """A dispatch plan that wants `chunk` tasks a claim and places none: what each claim of a pass
    returned, in order (the store's dispatch is real; placement is not what these tests look at)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.claims: list[list[uuid.UUID]] = []

    def begin(self, changed: Any, room: Any, horizon: Any, operations: Any) -> None:
        pass

    def want(self, claimed: int, limit: int) -> int:
        return self.chunk

    def place(self, tasks: Any) -> tuple[list[Any], dict[uuid.UUID, str]]:
        self.claims.append([t.id for t in tasks])
        return [], {}

    def foresee(self, tasks: Any) -> list[Any]:
        return []


async def _pass(store: Store, plan: _Watching, sub: Submissions) -> Any:
    return await store.dispatch(claim_limit=10, accept_seconds=30, lease_seconds=30, plan=plan, actor="scheduler:test",
                                submissions=[sub])  # fmt: skip


async def test_a_pass_claims_on_after_the_claim_that_stored_its_submission(store: Store) -> None:
    # the new task outranks the queue: the first claim (chunks of 2) cuts a queued task it locked,
    # and the pass's next claim returns it and the rest
    olds = [await submit(store, priority=0) for _ in range(3)]
    sub = _subs(store, TaskSpec(command=["true"], priority=5))
    plan = _Watching(2)
    out = await _pass(store, plan, sub)
    assert plan.claims == [[sub.ids[0], olds[0]], [olds[1], olds[2]], []]
    assert out.claimed == 4 and not out.held and list(out.submitted[0]) == list(sub.ids)


async def test_a_pass_with_no_room_to_claim_for_still_stores_its_submission(store: Store) -> None:
    sub = _subs(store, TaskSpec(command=["true"]))
    plan = _Watching(0)
    out = await _pass(store, plan, sub)
    assert list(out.submitted[0]) == list(sub.ids) and plan.claims == []
    assert (await store.get_task(sub.ids[0])).state == "queued"


async def test_a_submission_its_handler_stored_first_is_answered_as_not_stored_by_the_pass(store: Store) -> None:
    sub = _subs(store, TaskSpec(command=["true"]))
    await store.submit_many([(TaskSpec(command=["true"]), None)], actor="op", ids=sub.ids)
    out = await _pass(store, _Watching(2), sub)
    assert out.submitted == [], "stored by its handler: the pass answers that it stored nothing of it"
