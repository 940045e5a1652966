"""The dry run (`POST /v1/tasks/check`, `podium submit --check`) accounts for egress contexts (seed
Requirements.EgressContext against a runner's SupportedEgressContexts): a spec needing an egress no
node can give is "no compatible runner", each node saying so. The real app over a real Store."""

from __future__ import annotations

import httpx

from podium import reasons
from podium.store import Store
from tests.integration.test_revision import env  # noqa: F401 - the fixture

SPEC = {"backend": "container", "image": "registry.example/app@sha256:" + "a" * 64, "command": ["true"]}


async def container_node(store: Store, node_id: str, egress: list[str]) -> None:
    await store.node_hello(
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels={}, capabilities=[],
        backends=["container", "process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[],
        cpu_millis=4000, memory_bytes=8 * 2**30, disk_bytes=10 * 2**30, gpus=0, slots=4, gateway_id="test",
        agent_version="test", egress_contexts=egress,
    )  # fmt: skip


async def test_check_refuses_an_egress_no_node_can_give(env: tuple[Store, httpx.AsyncClient]) -> None:  # noqa: F811
    store, client = env
    await container_node(store, "open-only", ["open"])
    r = await client.post("/v1/tasks/check", json={**SPEC, "egress": "none"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["runnable"] is False and body["reason"] == reasons.NO_COMPATIBLE_RUNNER
    assert [(n["node_id"], n["failed"]) for n in body["nodes"]] == [("open-only", reasons.NO_EGRESS)]
    # the egress it can give is fine, and a node that can give "none" makes the first one runnable
    assert (await client.post("/v1/tasks/check", json={**SPEC, "egress": "open"})).json()["runnable"] is True
    await container_node(store, "sealed", ["none", "open"])
    body = (await client.post("/v1/tasks/check", json={**SPEC, "egress": "none"})).json()
    assert body["runnable"] is True
    assert {n["node_id"]: n["failed"] for n in body["nodes"]} == {"open-only": reasons.NO_EGRESS, "sealed": None}
    async with store.pool.acquire() as c:
        assert await c.fetchval("SELECT count(*) FROM tasks") == 0  # a dry run stores nothing
