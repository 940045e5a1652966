"""The assignment revision: every change of a task's assignment bumps it in the same statement, the API
returns it (and an ETag), and `If-Match` on cancel refuses a stale one with 412 naming both.

The real app over a real Store on PostgreSQL 15, driven in-process through httpx's ASGI transport."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import httpx
import pytest

from podium.api.app import create_app
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.states import TaskState
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node, place, submit


@pytest.fixture
async def env(e2e_db_url: str) -> AsyncIterator[tuple[Store, httpx.AsyncClient]]:
    store = await Store.connect(e2e_db_url, min_size=1, max_size=4)
    scheduler = Scheduler(store, DEFAULT_TIMING, server_id="revision")
    security = Security(store, SecretBox(os.urandom(32)))
    _row, token = await security.create_token("test-admin", Role.ADMIN, by="test")
    app = create_app(store, scheduler, security)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://podium",
                                 headers={"Authorization": f"Bearer {token}"}) as client:  # fmt: skip
        yield store, client
    await scheduler.close()
    await store.close()


async def test_every_assignment_change_bumps_the_revision(env: tuple[Store, httpx.AsyncClient]) -> None:
    store, _client = env
    tid = await submit(store)
    assert (await store.get_task(tid)).revision == 1
    await add_node(store, "n1")
    await place(store)  # queued → assigned, by the dispatch batch
    assert (await store.get_task(tid)).revision == 2
    # a compare-and-set naming a stale revision changes nothing, even with the right `from`
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.PROVISIONING, actor="t", revision=1) is None
    row = await store.get_task(tid)
    assert (row.state, row.revision) == ("assigned", 2)
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.PROVISIONING, actor="t", revision=2)
    assert (await store.get_task(tid)).revision == 3
    assert await store.transition_task(tid, TaskState.PROVISIONING, TaskState.RUNNING, actor="t")  # no If-Match: any
    assert (await store.get_task(tid)).revision == 4


async def test_cancel_with_a_stale_revision_is_refused_and_a_current_one_accepted(
    env: tuple[Store, httpx.AsyncClient],
) -> None:
    store, client = env
    tid = await submit(store)
    await add_node(store, "n1")
    r = await client.get(f"/v1/tasks/{tid}")
    assert r.status_code == 200 and r.json()["revision"] == 1 and r.headers["ETag"] == '"1"'
    await place(store)  # the task moved on since the client read it

    stale = await client.post(f"/v1/tasks/{tid}/cancel", headers={"If-Match": r.headers["ETag"]})
    assert stale.status_code == 412, stale.text
    assert "revision 2" in stale.json()["error"] and "revision 1" in stale.json()["error"]
    row = await store.get_task(tid)
    assert (row.state, row.revision) == ("assigned", 2)  # nothing changed

    bad = await client.post(f"/v1/tasks/{tid}/cancel", headers={"If-Match": "yesterday"})
    assert bad.status_code == 422 and "If-Match" in bad.json()["error"]

    current = await client.get(f"/v1/tasks/{tid}")
    assert current.headers["ETag"] == '"2"'
    ok = await client.post(f"/v1/tasks/{tid}/cancel", headers={"If-Match": current.headers["ETag"]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["state"] == "cancelling" and ok.json()["revision"] == 3 and ok.headers["ETag"] == '"3"'


async def test_label_change_with_a_stale_node_revision_is_refused(env: tuple[Store, httpx.AsyncClient]) -> None:
    store, client = env
    await add_node(store, "n1", labels={"zone": "a"})
    read = await client.get("/v1/nodes/n1")
    assert read.status_code == 200 and read.headers["ETag"] == f'"{read.json()["revision"]}"'
    first = await client.put("/v1/nodes/n1/labels", json={"labels": {"zone": "b"}}, headers={"If-Match": read.headers["ETag"]})
    assert first.status_code == 200, first.text
    assert first.json()["revision"] == read.json()["revision"] + 1
    # a second operator who read the node before the first change
    stale = await client.put("/v1/nodes/n1/labels", json={"labels": {"zone": "c"}}, headers={"If-Match": read.headers["ETag"]})
    assert stale.status_code == 412, stale.text
    assert f"revision {first.json()['revision']}" in stale.json()["error"]
    assert f"revision {read.json()['revision']}" in stale.json()["error"]
    assert (await client.get("/v1/nodes/n1")).json()["labels"] == {"zone": "b"}


async def test_a_profile_revision_mismatch_names_both_revisions_and_the_fix(env: tuple[Store, httpx.AsyncClient]) -> None:
    import pytest

    from podium.errors import ProfileRevisionMismatch
    from podium.spec import TaskSpec

    store, client = env
    await store.put_named_spec("nightly", TaskSpec(command=["echo", "v1"]), "t")
    await store.put_named_spec("nightly", TaskSpec(command=["echo", "v2"]), "t")
    with pytest.raises(ProfileRevisionMismatch) as e:
        await store.submit_named("nightly", 1, idempotency_key=None, actor="t")
    msg = str(e.value)
    assert "revision 2" in msg and "revision 1" in msg and "`podium spec run nightly --revision 2`" in msg
    r = await client.post("/v1/specs/nightly/submit", json={"revision": 1})
    assert r.status_code == 409 and "profile revision mismatch" in r.json()["error"]
    assert await store.list_tasks() == []  # nothing stored


async def test_a_pinned_task_keeps_its_revisions_content_on_every_attempt(env: tuple[Store, httpx.AsyncClient]) -> None:
    import asyncpg
    import pytest

    from podium.spec import TaskSpec

    store, _client = env
    await store.put_named_spec("job", TaskSpec(command=["echo", "v1"], max_attempts=2), "t")
    row, _ = await store.submit_named("job", 1, idempotency_key=None, actor="t")
    tid = row.id
    await store.put_named_spec("job", TaskSpec(command=["echo", "v2"], max_attempts=2), "t")  # a new revision meanwhile
    await add_node(store, "n1")
    sent = []
    for _attempt in range(2):
        await place(store)
        task = await store.get_task(tid)
        (assign,) = [r for r in await store.take_outbox(["n1"]) if r.kind == "assign"]
        sent.append(json.loads(assign.spec)["command"])
        # the node never accepts: revoked and requeued for the second attempt
        await store.transition_task(tid, TaskState.ASSIGNED, TaskState.QUEUED, actor="t", end_attempt="revoked",
                                    fencing_token=task.fencing_token)  # fmt: skip
    assert sent == [["echo", "v1"], ["echo", "v1"]]
    assert ((await store.get_task(tid)).spec_name, (await store.get_task(tid)).spec_revision) == ("job", 1)
    # and the revision itself can never be changed under the task
    async with store.pool.acquire() as c:
        with pytest.raises(asyncpg.exceptions.RestrictViolationError, match="store a new revision"):
            await c.execute("UPDATE named_specs SET spec = '{}' WHERE name = 'job' AND revision = 1")
