"""PostgreSQL connections killed under load (pg_terminate_backend): the server recovers by itself
and no acknowledged submission is lost."""

from __future__ import annotations

import asyncio
import threading
import time

import asyncpg
import httpx

from tests.acceptance.conftest import Cluster
from tests.harness import assert_at_most_one_attempt_at_once, wait_for

# The workload is bounded by count as well as time, so its outcome does not depend on the machine's
# speed: a fast machine stops at MAX_SUBMISSIONS (not thousands), a slow one carries on past the
# SUBMIT_SECONDS until it has MIN_SUBMISSIONS (within SLOW_LIMIT_SECONDS).
SUBMIT_SECONDS = 8
MIN_SUBMISSIONS = 20
MAX_SUBMISSIONS = 400
SLOW_LIMIT_SECONDS = 120


def _all_tasks(http: httpx.Client) -> list[dict]:
    """Every task, page by page (the listing's Link: rel="next"), however many there are."""
    out: list[dict] = []
    url: str | None = "/v1/tasks?limit=1000"
    while url is not None:
        r = http.get(url)
        assert r.status_code == 200, r.text
        out += r.json()
        url = r.links.get("next", {}).get("url")
    return out


def _killer(db_url: str, stop: threading.Event, killed: list[int]) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(db_url)
        try:
            dbname = await conn.fetchval("SELECT current_database()")
            while not stop.is_set():
                n = await conn.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                    dbname,
                )
                killed.append(n)
                await asyncio.sleep(1.0)
        finally:
            await conn.close()

    asyncio.run(run())


def test_killed_database_connections_lose_no_acknowledged_submission(cluster: Cluster) -> None:
    assert cluster.db_url
    srv = cluster.server()
    cluster.agent("a", slots=8)
    cluster.agent("b", slots=8)
    stop = threading.Event()
    killed: list[int] = []
    killer = threading.Thread(target=_killer, args=(cluster.db_url, stop, killed), daemon=True)
    killer.start()
    acknowledged: dict[str, str] = {}  # idempotency key → task id
    refused = 0
    try:
        with httpx.Client(base_url=srv.api, timeout=30, headers={"Authorization": f"Bearer {srv.admin_token}"}) as http:
            started = time.monotonic()
            i = 0
            while len(acknowledged) < MAX_SUBMISSIONS:
                elapsed = time.monotonic() - started
                if elapsed >= SUBMIT_SECONDS and len(acknowledged) >= MIN_SUBMISSIONS:
                    break
                assert elapsed < SLOW_LIMIT_SECONDS, f"only {len(acknowledged)} submissions acknowledged"
                key = f"job-{i}"
                # a client that did not get an answer retries with the same key, as it should
                for _attempt in range(20):
                    try:
                        r = http.post("/v1/tasks", json={"command": ["true"], "idempotency_key": key})
                    except httpx.HTTPError:
                        refused += 1
                        time.sleep(0.05)
                        continue
                    if r.status_code in (200, 201):
                        acknowledged[key] = r.json()["task"]["id"]
                        break
                    assert r.status_code in (429, 503), r.text  # never a 500 (429: shedding, nothing stored)
                    refused += 1
                    time.sleep(0.05)
                i += 1
    finally:
        stop.set()
        killer.join(10)
    assert sum(killed) > 0, "the fault was never injected"
    assert len(acknowledged) >= MIN_SUBMISSIONS
    # the server is still alive and every acknowledged task runs to the end, exactly once
    assert srv.alive()
    for key, tid in acknowledged.items():
        t = cluster.api.wait_state(tid, ("succeeded", "failed", "lost", "cancelled"), 120)
        assert t["state"] == "succeeded", (key, t)
        assert t["idempotency_key"] == key
    tasks = _all_tasks(cluster.api.http)
    assert len(tasks) == len(acknowledged), "a retried submission created a second task"
    assert {t["id"] for t in tasks} == set(acknowledged.values())
    wait_for(lambda: all(n["reserved"]["slots"] == 0 for n in cluster.api.nodes()), 30)
    assert_at_most_one_attempt_at_once(cluster.agents)
