"""`podium submit --check` and `POST /v1/tasks/check`: whether any node of the fleet could ever run a
spec (hard compatibility, ignoring what is free, connected or draining now), with each node's
explanation, storing nothing. Real server, real agent, real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import asyncpg

from podium import reasons
from podium.cli.main import EXIT_NO_RUNNER
from tests.acceptance.conftest import Cluster
from tests.harness import cli

TABLES = ("tasks", "task_events", "attempts", "audit_log")


def counts(db_url: str) -> dict[str, int]:
    async def read() -> dict[str, int]:
        conn = await asyncpg.connect(db_url)
        try:
            return {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
        finally:
            await conn.close()

    return asyncio.run(read())


def spec_file(tmp: Path, name: str, **spec: object) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"command": ["true"], **spec}))
    return str(path)


def test_check_says_whether_any_node_could_ever_run_the_spec(cluster: Cluster, tmp_path: Path, e2e_db_url: str) -> None:
    srv = cluster.server()
    a = cluster.agent("n1", labels={"zone": "a"}, cpu="2")
    node_id = a.node_id()
    cluster.api.wait_node("n1", connected=True, health="online")
    # a drained, busy node can still run the spec some day: drains and load are not hard facts
    assert cli(srv.api, "drain", "n1").returncode == 0
    before = counts(e2e_db_url)

    wrong_zone = cli(srv.api, "submit", "--check", spec_file(tmp_path, "zone", labels={"zone": "b"}))
    assert wrong_zone.returncode == EXIT_NO_RUNNER, wrong_zone.stdout + wrong_zone.stderr
    assert reasons.NO_COMPATIBLE_RUNNER in wrong_zone.stdout
    assert reasons.NO_LABELS in wrong_zone.stdout and node_id in wrong_zone.stdout

    too_big = cli(srv.api, "submit", "--check", "--json", spec_file(tmp_path, "big", resources={"cpu": 64}))
    assert too_big.returncode == EXIT_NO_RUNNER, too_big.stderr
    answer = json.loads(too_big.stdout)
    assert answer["runnable"] is False and answer["reason"] == reasons.NO_COMPATIBLE_RUNNER
    assert [(n["node_id"], n["fits"], n["failed"]) for n in answer["nodes"]] == [(node_id, False, reasons.TOO_LARGE)]

    fits = cli(srv.api, "submit", "--check", spec_file(tmp_path, "fits", labels={"zone": "a"}, resources={"cpu": 2}))
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "can run this spec" in fits.stdout

    r = cluster.api.http.post("/v1/tasks/check", json={"command": ["true"], "pool": "gpu"})
    assert r.status_code == 200, r.text
    assert r.json()["runnable"] is False and r.json()["nodes"][0]["failed"] == reasons.NO_POOL
    bad = cluster.api.http.post("/v1/tasks/check", json={"command": []})
    assert bad.status_code == 422 and "command" in bad.json()["error"]

    # nothing was stored by any of it
    assert counts(e2e_db_url) == before
