"""The event stream end to end: a client that reconnects with Last-Event-ID gets every event it
missed, in order, none twice, across a server restart; the SSE log follow resumes by chunk id."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.harness import ADMIN_TOKENS, wait_for

pytestmark = pytest.mark.slow


def read_events(base: str, n: int, *, last_id: str | None = None, path: str = "/v1/events",
                timeout: float = 60) -> list[dict[str, Any]]:  # fmt: skip
    """The first n events of a stream (each {"id", "event", "data"}), or fail after `timeout`."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKENS[base]}"}
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    out: list[dict[str, Any]] = []
    result: list[BaseException] = []

    def run() -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(10, read=timeout)) as c, c.stream("GET", base + path, headers=headers) as r:
                assert r.status_code == 200, r.read()
                cur: dict[str, Any] = {}
                for line in r.iter_lines():
                    if line == "":
                        if "data" in cur:
                            out.append(cur)
                            if len(out) >= n:
                                return
                        cur = {}
                    elif line.startswith(":"):
                        continue
                    else:
                        k, _, v = line.partition(": ")
                        cur[k] = cur[k] + "\n" + v if k == "data" and k in cur else v
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout + 5)
    if result:
        raise result[0]
    assert len(out) >= n, f"only {len(out)} of {n} events arrived: {out}"
    return out


def count_events(cluster: Cluster) -> int:
    import asyncio

    import asyncpg

    async def q() -> int:
        c = await asyncpg.connect(cluster.db_url)
        try:
            return int(await c.fetchval("SELECT (SELECT count(*) FROM task_events) + (SELECT count(*) FROM node_states)"))
        finally:
            await c.close()

    return asyncio.run(q())


def test_resume_with_last_event_id_gets_every_missed_event_in_order_none_twice_across_a_restart(cluster: Cluster) -> None:
    server = cluster.server()
    cluster.agent("n1")
    api = cluster.api
    api.wait_node("n1", connected=True)
    first = [api.submit(command=["echo", f"a{i}"])["id"] for i in range(3)]
    for tid in first:
        api.wait_state(tid, "succeeded")
    seen = read_events(server.api, 6, path="/v1/events?after=0")
    last = seen[-1]["id"]

    # the server restarts (same database, same ports); more happens while the client is away
    port, grpc_port = server.port, server.grpc_port
    server.stop()
    server = cluster.server(port=port, grpc_port=grpc_port)
    api = cluster.api
    api.wait_node("n1", connected=True)
    second = [api.submit(command=["echo", f"b{i}"])["id"] for i in range(3)]
    for tid in second:
        api.wait_state(tid, "succeeded")
    queued = api.submit(command=["true"], labels={"nowhere": "x"})["id"]
    wait_for(lambda: api.task(queued)["reason"] == reasons.NO_LABELS, 30, what="the queued reason")
    assert api.http.post(f"/v1/tasks/{queued}/cancel").status_code == 200

    total = count_events(cluster)
    everything = read_events(server.api, total, path="/v1/events?after=0")
    ids = [e["id"] for e in everything]
    assert len(set(ids)) == len(ids) == total
    resumed = read_events(server.api, total - len(seen), last_id=last)
    assert [e["id"] for e in resumed] == ids[len(seen):]  # every missed event, in order, none twice
    assert ids[: len(seen)] == [e["id"] for e in seen]
    task_events = [json.loads(e["data"]) for e in resumed if e["event"] == "task"]
    for tid in second:
        assert [e["state"] for e in task_events if e["task_id"] == tid] == [
            "queued", "assigned", "provisioning", "running", "succeeded"]  # fmt: skip
    mine = [e for e in task_events if e["task_id"] == queued]
    assert mine[-1]["state"] == "cancelled" and mine[-1]["reason"] == reasons.CANCELLED
    nodes = [json.loads(e["data"]) for e in resumed if e["event"] == "node"]
    assert any(n["connected"] for n in nodes)  # the node coming back after the restart
    # filters: one task's events only
    only = read_events(server.api, 5, path=f"/v1/events?after=0&task={second[0]}")
    assert {json.loads(e["data"])["task_id"] for e in only} == {second[0]}


def test_log_stream_follows_and_resumes_by_chunk_id(cluster: Cluster) -> None:
    server = cluster.server()
    cluster.agent("n1")
    api = cluster.api
    api.wait_node("n1", connected=True)
    tid = api.submit(command=["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.3; done"])["id"]
    events = []
    while True:  # read until the end event, whatever the chunking
        batch = read_events(server.api, 1, path=f"/v1/tasks/{tid}/logs/stream",
                            last_id=events[-1]["id"] if events else None)  # fmt: skip
        events.append(batch[0])
        if batch[0]["event"] == "end":
            break
    chunks = [json.loads(e["data"]) for e in events if e["event"] == "chunk"]
    assert "".join(c["data"] for c in chunks) == "line1\nline2\nline3\n"
    assert len({c["id"] for c in chunks}) == len(chunks)  # each resume continued after the last, none twice
    end = json.loads(events[-1]["data"])
    assert end["state"] == "succeeded" and end["exit_code"] == 0
    auth = {"Authorization": f"Bearer {ADMIN_TOKENS[server.api]}"}
    bad = httpx.get(f"{server.api}/v1/events?state=dancing", headers=auth)
    assert bad.status_code == 422 and "dancing" in bad.json()["error"]
    bad = httpx.get(f"{server.api}/v1/events?state=running,dancing", headers=auth)
    assert bad.status_code == 422 and "'dancing' is not a task state" in bad.json()["error"]
    bad = httpx.get(f"{server.api}/v1/events?state=running,,succeeded", headers=auth)
    assert bad.status_code == 422 and "empty name" in bad.json()["error"]
    # several states: this task's way into them and nothing else, from the stored events on
    limited = read_events(server.api, 2, path=f"/v1/events?after=0&task={tid}&state=running,succeeded")
    assert [(json.loads(e["data"])["task_id"], json.loads(e["data"])["state"]) for e in limited] == [
        (tid, "running"), (tid, "succeeded")]
    assert httpx.get(f"{server.api}/v1/events").status_code == 401
