"""`from podium import Client, AsyncClient` against a real server and agent."""

from __future__ import annotations

import asyncio
import threading

import pytest

from podium import AsyncClient, Client, reasons
from podium.client import Event, PodiumError
from tests.acceptance.conftest import Cluster

pytestmark = pytest.mark.slow


def test_sync_client_runs_cancels_follows_and_streams_events(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    server = cluster.server()
    cluster.agent("n1")
    cluster.api.wait_node("n1", connected=True)
    # discovered the way the CLI discovers them
    monkeypatch.setenv("PODIUM_ADDR", server.api)
    monkeypatch.setenv("PODIUM_TOKEN", server.admin_token)
    with Client() as c:
        nodes = c.nodes()
        assert [n.name for n in nodes] == ["n1"] and nodes[0].connected

        result = c.run(["sh", "-c", "echo out; echo err >&2; exit 3"], name="three")
        assert result.exit_code == 3 and not result.ok
        assert result.task.state == "failed" and result.task.reason == reasons.EXITED_NONZERO
        assert sorted(result.output.splitlines()) == ["err", "out"]

        ok = c.run(["echo", "fine"])
        assert (ok.exit_code, ok.output, ok.ok) == (0, "fine\n", True)

        # events(): the stream of one task, as it happens
        seen: list[Event] = []
        long = c.submit(["sleep", "60"], name="long")

        def watch() -> None:
            with Client() as w:
                for e in w.events(task=long.id, after=0):
                    seen.append(e)
                    if e.state == "cancelled":
                        return

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        c.logs(long.id)  # a finished-or-not task's logs so far: a plain read
        for _ in range(600):
            if c.task(long.id).state == "running":
                break
            threading.Event().wait(0.1)
        cancelled = c.cancel(long.id)
        assert cancelled.state in ("cancelling", "cancelled")
        t.join(60)
        assert [e.state for e in seen][:4] == ["queued", "assigned", "provisioning", "running"]
        assert seen[-1].state == "cancelled" and seen[-1].reason == reasons.CANCELLED
        assert all(e.task_id == long.id for e in seen)

        with pytest.raises(PodiumError) as err:
            c.task("not-a-task")
        assert err.value.status == 422 and "not a task id" in str(err.value)
    with Client(token="pdm_nope.nope") as bad, pytest.raises(PodiumError) as err:
        bad.nodes()
    assert err.value.status == 401


def test_async_client(cluster: Cluster) -> None:
    server = cluster.server()
    cluster.agent("n1")
    cluster.api.wait_node("n1", connected=True)

    async def main() -> None:
        async with AsyncClient(server.api, token=server.admin_token) as c:
            assert [n.name for n in await c.nodes()] == ["n1"]
            r = await c.run(["sh", "-c", "echo a; sleep 0.5; echo b"])
            assert (r.exit_code, r.output) == (0, "a\nb\n")
            chunks = [ch.data async for ch in c.logs(r.task.id)]
            assert "".join(chunks) == "a\nb\n"
            events = []
            async for e in c.events(task=r.task.id, after=0):
                events.append(e.state)
                if e.state == "succeeded":
                    break
            assert events == ["queued", "assigned", "provisioning", "running", "succeeded"]

    asyncio.run(main())
