"""Helpers for store tests: nodes registered and tasks placed through the real store statements."""

from __future__ import annotations

import uuid
from typing import Any

from podium.scheduler.service import Scheduler
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.db import DEFAULT_MAX_OPERATIONS
from podium.timing import DEFAULT_TIMING


async def add_node(store: Store, node_id: str = "n1", *, slots: int = 4, cpu: int = 4000, memory: int = 8 * 2**30,
                   labels: dict[str, str] | None = None, max_operations: int | None = None) -> Any:  # fmt: skip
    # by default a node may prepare as many tasks at once as it has slots: only tests of the
    # operations limit (Capacity.Operations) set a lower one
    row = await store.node_hello(
        max_operations=max_operations or max(slots, DEFAULT_MAX_OPERATIONS),
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels=labels or {}, capabilities=[],
        backends=["process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=cpu,
        memory_bytes=memory, disk_bytes=10 * 2**30, gpus=0, slots=slots, gateway_id="test", agent_version="test",
    )  # fmt: skip
    assert row is not None
    return row


async def submit(store: Store, **spec: Any) -> uuid.UUID:
    spec.setdefault("command", ["true"])
    row, _ = await store.submit(TaskSpec(**spec))
    return row.id


def scheduler(store: Store) -> Scheduler:
    return Scheduler(store, DEFAULT_TIMING, server_id="test")


async def place(store: Store) -> Any:
    return await scheduler(store).dispatch_once()


async def node_row(store: Store, node_id: str) -> Any:
    async with store.pool.acquire() as c:
        return await c.fetchrow("SELECT * FROM nodes WHERE id = $1", node_id)


async def running_on_n1(store: Store, **spec: Any) -> tuple[uuid.UUID, int]:
    """A task placed on a new node "n1" and taken through `provisioning` to `running` as that node
    would report them: its id and fencing token."""
    from podium.states import TaskState as S

    await add_node(store, "n1")
    tid = await submit(store, **spec)
    await place(store)
    tok = (await store.get_task(tid)).fencing_token
    for a, b in ((S.ASSIGNED, S.PROVISIONING), (S.PROVISIONING, S.RUNNING)):
        assert await store.transition_task(tid, a, b, actor="node:n1", fencing_token=tok, node_id="n1")
    return tid, tok
