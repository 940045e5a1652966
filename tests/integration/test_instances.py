"""Agent instances made durable: who holds a node's identity, who was superseded, and how long the
attempts the new instance does not report stay the node's."""

from __future__ import annotations

from typing import Any

from podium import reasons
from podium.store import Store
from tests.integration.helpers import node_row, place, scheduler, submit

HANDOVER = 30.0  # seconds past the old instance's last recorded heartbeat


async def hello(store: Store, instance: str, peer: str = "") -> Any:
    return await store.instance_hello(
        node_id="n1", name="n1", pool="default", arch="x86_64", labels={}, capabilities=[], backends=["process"],
        artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=4000, memory_bytes=2**33,
        disk_bytes=2**34, gpus=0, slots=4, gateway_id="test", agent_version="test", instance_id=instance, peer=peer,
        handover_after=HANDOVER,
    )  # fmt: skip


async def test_a_new_instance_supersedes_the_old_which_can_never_take_the_node_back(store: Store) -> None:
    first = await hello(store, "host/1/aaaa", "ipv4:10.0.0.1:5000")
    assert first.row is not None and first.superseded is None
    again = await hello(store, "host/1/aaaa", "ipv4:10.0.0.1:5001")  # the same instance reconnecting: nothing happens
    assert again.superseded is None and (await node_row(store, "n1"))["handover_until"] is None
    await store.heartbeats([("n1", again.row.session)], "test")
    beat_at = (await node_row(store, "n1"))["last_heartbeat_at"]

    second = await hello(store, "other/2/bbbb", "ipv4:10.0.0.2:6000")
    assert second.superseded == "host/1/aaaa" and second.row.session == again.row.session + 1
    node = await node_row(store, "n1")
    assert node["instance_id"] == "other/2/bbbb"
    # the old instance's fence deadline runs from its last recorded heartbeat, not from this Hello
    assert (node["handover_until"] - beat_at).total_seconds() == HANDOVER
    events = await store.node_events("n1")
    assert [e.kind for e in events] == ["superseded"]
    assert events[0].detail["old"] == "host/1/aaaa" and events[0].detail["new"] == "other/2/bbbb"
    assert "10.0.0.1" in events[0].message and "10.0.0.2" in events[0].message

    # the old one comes back: refused, nothing recorded (no new session, the node stays the new one's)
    back = await hello(store, "host/1/aaaa")
    assert back.row is None and back.refused_by == "other/2/bbbb"
    node = await node_row(store, "n1")
    assert node["instance_id"] == "other/2/bbbb" and node["session"] == second.row.session
    assert len(await store.node_events("n1")) == 1


async def test_unreported_attempts_wait_for_the_handover_deadline_then_the_watchdog_gives_them_up(store: Store) -> None:
    await hello(store, "host/1/aaaa")
    tid = await submit(store)
    out = await place(store)
    ((_tid, _node, token),) = out.assigned
    await hello(store, "host/2/bbbb")
    # within the deadline: kept on the node
    assert await store.defer_node_loss("n1", [token]) is True
    sched = scheduler(store)
    await sched.sweep()
    assert (await store.get_task(tid)).state == "assigned"
    assert (await node_row(store, "n1"))["handover_tokens"] == [token]
    # the deadline passes (moved back rather than waited for): the next sweep gives it up, once
    async with store.pool.acquire() as c:
        await c.execute("UPDATE nodes SET handover_until = now() - interval '1 second' WHERE id = 'n1'")
    assert await store.defer_node_loss("n1", [token]) is False  # a late reconcile applies the policy itself
    await sched.sweep()
    task = await store.get_task(tid)
    assert (task.state, task.reason) == ("queued", reasons.INSTANCE_REPLACED)
    assert (await node_row(store, "n1"))["handover_tokens"] == []
    assert [e.kind for e in await store.node_events("n1")] == ["superseded", "handover"]
