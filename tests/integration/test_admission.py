"""Admission control: an overloaded server refuses submissions with 429 and Retry-After, says why,
stores nothing, and takes them again once it has caught up. Reads are never refused.

The real app over a real Store (system PostgreSQL 15) through httpx's ASGI transport; the server's
load is set on its `Pressure` directly (what the server's lag probe and report backlog would feed it).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from podium.api.app import create_app
from podium.errors import Overloaded
from podium.pressure import DEFAULT_MAX_LAG, Pressure
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.spec import TaskSpec
from podium.store import Store
from podium.timing import DEFAULT_TIMING


class Backlog:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        return self.n


@pytest.fixture
async def setup(e2e_db_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Store, Pressure, Backlog]]:
    store = await Store.connect(e2e_db_url, min_size=1, max_size=3)
    security = Security(store, SecretBox(os.urandom(32)))
    _row, token = await security.create_token("admission", Role.OPERATOR, by="test")
    await store.put_named_spec("nightly", TaskSpec(command=["true"]), "test")
    backlog = Backlog()
    pressure = Pressure(backlog=backlog)
    app = create_app(store, Scheduler(store, DEFAULT_TIMING, server_id="admission"), security, pressure)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://podium", headers=headers) as client:
        yield client, store, pressure, backlog
    await store.close()


async def task_count(store: Store) -> int:
    async with store.pool.acquire() as c:
        return int(await c.fetchval("SELECT count(*) FROM tasks"))


SUBMISSIONS: list[tuple[str, Any]] = [
    ("/v1/tasks", {"command": ["true"]}),
    ("/v1/tasks/batch", {"tasks": [{"command": ["true"]}] * 3}),
    ("/v1/specs/nightly/submit", {}),
]


async def test_an_overloaded_server_refuses_submissions_stores_nothing_and_recovers(setup: Any) -> None:
    client, store, pressure, backlog = setup
    for _ in range(20):
        pressure.observe(2.0, 1.0)  # the event loop is two seconds behind, with the server on a full core
    assert pressure.lag > DEFAULT_MAX_LAG
    for path, body in SUBMISSIONS:
        r = await client.post(path, json=body)
        assert r.status_code == 429, (path, r.text)
        assert r.headers["Retry-After"] == "1"
        assert "overloaded" in r.json()["error"] and "event loop" in r.json()["error"] and "nothing was stored" in r.json()["error"]
    assert await task_count(store) == 0
    assert pressure.shed == 1 + 3 + 1
    assert (await client.get("/v1/tasks")).status_code == 200  # reads are never shed
    # a bad submission is still told what is wrong with it, not to come back later
    assert (await client.post("/v1/tasks", json={"command": []})).status_code == 422

    for _ in range(40):
        pressure.observe(0.0, 1.0)  # caught up
    assert pressure.lag < DEFAULT_MAX_LAG
    for path, body in SUBMISSIONS:
        r = await client.post(path, json=body)
        assert r.status_code in (200, 201), (path, r.text)
    assert await task_count(store) == 1 + 3 + 1

    backlog.n = pressure.max_backlog + 1  # node reports are piling up
    r = await client.post("/v1/tasks", json={"command": ["true"]})
    assert r.status_code == 429 and "node reports are waiting" in r.json()["error"]
    assert await task_count(store) == 5


def test_pressure_smooths_its_lag_and_names_the_limit() -> None:
    p = Pressure(max_lag=0.1, max_backlog=10)
    p.observe(0.2, 1.0)  # one slow probe is not yet an overload
    assert p.why_overloaded() is None and p.lag == pytest.approx(0.06)
    for _ in range(10):
        p.observe(1.0, 1.0)
    assert "ms behind (limit 100 ms) while using" in (p.why_overloaded() or "")
    with pytest.raises(Overloaded) as e:
        p.admit(4)
    assert e.value.retry_after == 1 and p.shed == 4
    p.observe(float("nan"), 1.0)  # a nonsense probe changes nothing
    p.observe(-1.0, 1.0)
    assert p.lag > 0.1


def test_a_late_loop_on_a_starved_machine_is_not_an_overload() -> None:
    """Lag while the server gets little CPU means other processes have the cores: refusing work
    would not help, so nothing is refused."""
    p = Pressure(max_lag=0.1)
    for _ in range(20):
        p.observe(1.0, 0.1)
    assert p.lag > 0.9 and p.why_overloaded() is None
    p.admit()  # accepted
    for _ in range(20):
        p.observe(1.0, 0.95)
    assert p.why_overloaded() is not None
