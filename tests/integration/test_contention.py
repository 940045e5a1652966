"""Writes PostgreSQL refuses for contention are retried a bounded number of times, then fail with
Contention (the API: 503 with Retry-After), and both are counted in the metrics.

Real PostgreSQL 15: the test holds a node's row lock in a transaction of its own, and the store's
sessions run with a short `lock_timeout`, so every attempt of the store's write is refused with
"lock not available" for as long as the test holds the lock.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY

from podium.api.app import create_app
from podium.errors import Contention
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node, node_row


def _count(name: str, op: str) -> float:
    return REGISTRY.get_sample_value(name, {"operation": op}) or 0.0


async def _until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def short_lock_db(e2e_db_url: str) -> str:
    """The test's database, with every new session's lock_timeout at 100ms."""
    conn = await asyncpg.connect(e2e_db_url)
    try:
        db = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{db}\" SET lock_timeout = '100ms'")
    finally:
        await conn.close()
    return e2e_db_url


@pytest.fixture
async def held_node(short_lock_db: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Node n1, its row locked by an open transaction until the returned release() is awaited."""
    setup = await Store.connect(short_lock_db, min_size=1, max_size=1)
    await add_node(setup, "n1", labels={"zone": "a"})
    await setup.close()
    blocker = await asyncpg.connect(short_lock_db)
    tx = blocker.transaction()
    await tx.start()
    await blocker.execute("SELECT 1 FROM nodes WHERE id = 'n1' FOR UPDATE")
    released = False

    async def release() -> None:
        nonlocal released
        if not released:
            released = True
            await tx.rollback()

    yield release
    await release()
    await blocker.close()


async def test_past_the_limit_the_write_fails_with_contention(short_lock_db: str, held_node) -> None:
    store = await Store.connect(short_lock_db, min_size=1, max_size=2, serialization_retry_limit=2)
    try:
        retries, giveups = (_count("podium_serialization_retries_total", "set_labels"),
                            _count("podium_serialization_giveups_total", "set_labels"))  # fmt: skip
        with pytest.raises(Contention) as err:
            await store.set_labels("n1", {"zone": "b"})
        assert "contention" in str(err.value) and "3 times" in str(err.value) and "limit is 2" in str(err.value)
        assert _count("podium_serialization_retries_total", "set_labels") == retries + 2
        assert _count("podium_serialization_giveups_total", "set_labels") == giveups + 1
        await held_node()
        assert (await node_row(store, "n1"))["labels"] == {"zone": "a"}  # nothing was written
    finally:
        await store.close()


async def test_under_the_limit_the_write_succeeds_after_retries(short_lock_db: str, held_node) -> None:
    store = await Store.connect(short_lock_db, min_size=1, max_size=2, serialization_retry_limit=1000)
    try:
        retries, giveups = (_count("podium_serialization_retries_total", "set_labels"),
                            _count("podium_serialization_giveups_total", "set_labels"))  # fmt: skip
        write = asyncio.create_task(store.set_labels("n1", {"zone": "b"}))
        await _until(lambda: _count("podium_serialization_retries_total", "set_labels") >= retries + 2, "two retries")
        assert not write.done()
        await held_node()
        await asyncio.wait_for(write, 60)
        assert (await node_row(store, "n1"))["labels"] == {"zone": "b"}
        assert _count("podium_serialization_retries_total", "set_labels") >= retries + 2
        assert _count("podium_serialization_giveups_total", "set_labels") == giveups
    finally:
        await store.close()


async def test_api_answers_503_with_retry_after(short_lock_db: str, held_node) -> None:
    store = await Store.connect(short_lock_db, min_size=1, max_size=3, serialization_retry_limit=1)
    scheduler = Scheduler(store, DEFAULT_TIMING, server_id="contention")
    security = Security(store, SecretBox(os.urandom(32)))
    _row, token = await security.create_token("test-admin", Role.ADMIN, by="test")
    app = create_app(store, scheduler, security)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://podium") as client:
            r = await client.put("/v1/nodes/n1/labels", json={"labels": {"zone": "b"}},
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert "contention" in r.json()["error"]
            await held_node()
            r = await client.put("/v1/nodes/n1/labels", json={"labels": {"zone": "c"}},
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert r.status_code == 200, r.text
    finally:
        await scheduler.close()
        await store.close()
