"""The reconcile loop's claims and checks on real PostgreSQL (both servers): what an assignment
records, a claim that another replica must respect until it expires, a late answer from a replica
whose claim was taken over, and the checks that apply the node-loss policy (a node offline, a node
whose last Hello did not list an attempt it had) or wait (a handover, a node not connected).

Tests make attempts due (or claims expired) by writing those two times directly: the loop's clock
is the database's, and waiting out a real interval would only make the test slower."""

from __future__ import annotations

import uuid
from typing import Any

from podium import reasons
from podium.scheduler.reconcile import Reconciler
from podium.scheduler.service import Scheduler
from podium.states import TaskState
from podium.store import Store
from podium.store.reconcile import ReconcileStore
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node, place, submit


def reconciler(store: Store, name: str) -> Reconciler:
    return Reconciler(store, Scheduler(store, DEFAULT_TIMING, server_id=name).applier, DEFAULT_TIMING, server_id=name)


async def attempt(store: Store, tid: uuid.UUID) -> Any:
    async with store.pool.acquire() as c:
        return await c.fetchrow("SELECT * FROM attempts WHERE task_id = $1 ORDER BY attempt DESC LIMIT 1", tid)


async def make_due(store: Store) -> None:
    async with store.pool.acquire() as c:
        await c.execute("UPDATE attempts SET next_reconcile_at = now() WHERE finished_at IS NULL")


async def placed(store: Store, **spec: Any) -> uuid.UUID:
    tid = await submit(store, **spec)
    await place(store)
    assert (await store.get_task(tid)).state == "assigned"
    return tid


async def to_running(store: Store, tid: uuid.UUID) -> None:
    row = await store.get_task(tid)
    tok, node = row.fencing_token, row.node_id
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.PROVISIONING, actor="node", fencing_token=tok,
                                       node_id=node, attempt_state="provisioning")  # fmt: skip
    assert await store.transition_task(tid, TaskState.PROVISIONING, TaskState.RUNNING, actor="node", fencing_token=tok,
                                       node_id=node, attempt_state="running", backend_ref="4242")  # fmt: skip


async def test_an_assignment_records_what_it_was_decided_on(store: Store) -> None:
    await add_node(store, "n1", labels={"zone": "a"})
    tid = await placed(store, max_attempts=3, labels={"zone": "a"})
    a = await attempt(store, tid)
    snap = a["capability_snapshot"]
    assert snap["labels"] == {"zone": "a"} and snap["arch"] == "x86_64" and snap["backends"] == ["process"]
    assert snap["pool"] == "default" and snap["egress_contexts"] == ["open"] and snap["materializations"] == []
    assert (a["retry_count"], a["retry_limit"]) == (0, 2)
    assert a["next_reconcile_at"] > a["assigned_at"]  # due one reconcile interval after the assignment
    await to_running(store, tid)
    assert (await attempt(store, tid))["backend_ref"] == "4242"


async def test_a_live_claim_is_respected_and_an_expired_one_taken_over(store: Store) -> None:
    await add_node(store, "n1")
    tid = await placed(store)
    await make_due(store)
    a_store = ReconcileStore(store)
    claimed = await a_store.claim("replica-a", 10, 60.0)
    assert [r.task_id for r in claimed] == [tid]
    b = reconciler(store, "replica-b")
    assert await b.once() == 0  # replica-a's claim is live: replica-b leaves it alone
    row = await attempt(store, tid)
    assert (row["reconcile_owner"], row["last_reconciled_at"]) == ("replica-a", None)

    async with store.pool.acquire() as c:  # replica-a's claim runs out
        await c.execute("UPDATE attempts SET reconcile_claim_expires_at = now() - interval '1 second'")
    assert await b.once() == 1
    row = await attempt(store, tid)
    assert row["reconcile_owner"] is None and row["last_reconciled_by"] == "replica-b"
    assert row["last_reconcile_result"] == reasons.RECONCILED_CONSISTENT
    assert row["next_reconcile_at"] > row["last_reconciled_at"]
    # replica-a wakes up and answers late: its claim is gone, so nothing it says is recorded
    assert await a_store.finish("replica-a", [(row["fencing_token"], "stale", 0.0)]) == set()
    assert (await attempt(store, tid))["last_reconcile_result"] == reasons.RECONCILED_CONSISTENT
    # and nothing is due again before the next interval
    assert await b.once() == 0


async def test_an_attempt_on_an_offline_node_goes_through_the_node_loss_policy(store: Store) -> None:
    await add_node(store, "n1")
    tid = await placed(store, max_attempts=2)
    await to_running(store, tid)
    async with store.pool.acquire() as c:  # the node never came back
        await c.execute("UPDATE nodes SET health = 'offline', connected = false WHERE id = 'n1'")
    await make_due(store)
    assert await reconciler(store, "r").once() == 1
    task = await store.get_task(tid)
    assert (task.state, task.reason) == ("queued", reasons.NODE_LOST)  # requeued: one attempt left
    row = await attempt(store, tid)
    assert (row["state"], row["last_reconcile_result"]) == ("lost", reasons.RECONCILED_NODE_OFFLINE)


async def test_a_node_whose_last_hello_left_out_a_running_attempt_loses_it(store: Store) -> None:
    await add_node(store, "n1")
    kept, forgot = await placed(store, max_attempts=1), await placed(store, max_attempts=1)
    await to_running(store, kept)
    await to_running(store, forgot)
    # the node says Hello again, listing only one of the two it was running
    await store.node_hello(
        node_id="n1", name="n1", pool="default", arch="x86_64", labels={}, capabilities=[], backends=["process"],
        artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=4000, memory_bytes=8 * 2**30,
        disk_bytes=10 * 2**30, gpus=0, slots=4, gateway_id="test", agent_version="test",
        hello_tokens=[(await store.get_task(kept)).fencing_token],
    )  # fmt: skip
    await make_due(store)
    assert await reconciler(store, "r").once() == 2
    assert (await store.get_task(kept)).state == "running"
    assert (await attempt(store, kept))["last_reconcile_result"] == reasons.RECONCILED_CONSISTENT
    task = await store.get_task(forgot)
    assert (task.state, task.reason) == ("lost", reasons.NODE_FORGOT)
    assert (await attempt(store, forgot))["last_reconcile_result"] == reasons.RECONCILED_NODE_FORGOT


async def test_doubt_waits_a_disconnected_node_and_a_handover(store: Store) -> None:
    await add_node(store, "n1")
    tid = await placed(store)
    await to_running(store, tid)
    async with store.pool.acquire() as c:
        await c.execute("UPDATE nodes SET connected = false WHERE id = 'n1'")
    await make_due(store)
    await reconciler(store, "r").once()
    assert (await store.get_task(tid)).state == "running"
    assert (await attempt(store, tid))["last_reconcile_result"] == reasons.RECONCILED_DISCONNECTED
    async with store.pool.acquire() as c:  # another instance took over: its predecessor may still run it
        await c.execute("UPDATE nodes SET connected = true, hello_tokens = '{}', connected_at = now(), "
                        "handover_until = now() + interval '1 hour' WHERE id = 'n1'")  # fmt: skip
    await make_due(store)
    await reconciler(store, "r").once()
    assert (await store.get_task(tid)).state == "running"
    assert (await attempt(store, tid))["last_reconcile_result"] == reasons.RECONCILED_HANDOVER
    # the deadline just passed, but the watchdog has not dealt with the handover yet: still the
    # handover's (its reason says the agent process was replaced), not a node that forgot its work
    async with store.pool.acquire() as c:
        await c.execute("UPDATE nodes SET handover_until = now() - interval '1 second', "
                        "handover_tokens = ARRAY[$1::bigint] WHERE id = 'n1'", (await store.get_task(tid)).fencing_token)  # fmt: skip
    await make_due(store)
    await reconciler(store, "r").once()
    assert (await store.get_task(tid)).state == "running"
    assert (await attempt(store, tid))["last_reconcile_result"] == reasons.RECONCILED_HANDOVER


async def test_a_retry_records_its_place_in_the_budget(store: Store) -> None:
    await add_node(store, "n1")
    tid = await placed(store, max_attempts=3)
    row = await store.get_task(tid)
    assert await store.transition_task(tid, TaskState.ASSIGNED, TaskState.QUEUED, actor="t", end_attempt="revoked",
                                       fencing_token=row.fencing_token)  # fmt: skip
    await place(store)
    a = await attempt(store, tid)
    assert (a["attempt"], a["retry_count"], a["retry_limit"]) == (2, 1, 2)


def hello_with(runtime: str, tokens: list[int]) -> Any:
    from podium.proto.podium.v1 import agent_pb2 as pb

    return pb.Hello(node_id="n1", tasks=[pb.RunningTask(fencing_token=t, phase="running") for t in tokens], materializations=[
        pb.MaterializationSnapshot(backend_kind="process", architecture="x86_64", runtime_digest=runtime,
                                   toolchain_digest="sha256:tools")])  # fmt: skip


async def test_a_node_whose_runtime_changed_has_its_attempts_rechecked(store: Store) -> None:
    from podium.gateway.snapshots import hello_facts, revalidate

    facts = dict(name="n1", pool="default", arch="x86_64", labels={}, capabilities=[], backends=["process"], artifacts=[],
                 protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=4000, memory_bytes=8 * 2**30,
                 disk_bytes=10 * 2**30, gpus=0, slots=4, gateway_id="test", agent_version="test")  # fmt: skip
    first = await store.instance_hello(node_id="n1", **facts, **hello_facts(hello_with("sha256:old", [])))
    assert first.materializations_before == []
    tid = await placed(store)
    await to_running(store, tid)
    a = await attempt(store, tid)
    assert [m["runtime_digest"] for m in a["capability_snapshot"]["materializations"]] == ["sha256:old"]

    # the same runtime again: nothing to recheck
    same = hello_with("sha256:old", [a["fencing_token"]])
    again = await store.instance_hello(node_id="n1", **facts, **hello_facts(same))
    assert await revalidate(store, "n1", again.materializations_before, same) == []
    # the node comes back on another runtime, still running the attempt
    changed = hello_with("sha256:new", [a["fencing_token"]])
    decided = await store.instance_hello(node_id="n1", **facts, **hello_facts(changed))
    assert await revalidate(store, "n1", decided.materializations_before, changed) == [("process", "sha256:old", "sha256:new")]
    events = [e for e in await store.node_events("n1") if e.kind == "runtime_changed"]
    assert len(events) == 1 and events[0].detail["rechecked"] == [a["fencing_token"]]
    assert "sha256:old" in events[0].message and "sha256:new" in events[0].message
    # due at once, without anyone making it so: the reconcile loop says what it found
    assert await reconciler(store, "r").once() == 1
    row = await attempt(store, tid)
    assert row["last_reconcile_result"] == reasons.RECONCILED_RUNTIME_CHANGED
    assert (await store.get_task(tid)).state == "running"


async def test_a_node_prepares_no_more_than_its_operations_and_explain_says_so(store: Store) -> None:
    await add_node(store, "n1", slots=4, max_operations=1)
    first, second = await submit(store), await submit(store)
    out = await place(store)
    assert [a[0] for a in out.assigned] == [first] and out.unplaced == {second: reasons.OPERATIONS_BUSY}
    assert (await store.get_task(second)).reason == reasons.OPERATIONS_BUSY
    _task, verdicts, _avoid = await Scheduler(store, DEFAULT_TIMING, server_id="x").explain(second)
    assert [(v.node_id, v.failed) for v, _row in verdicts] == [("n1", reasons.OPERATIONS_BUSY)]
    # once the first runs, its operation is free again: the second is placed
    await to_running(store, first)
    assert [a[0] for a in (await place(store)).assigned] == [second]


async def test_the_reservation_refuses_more_operations_than_the_node_allows(store: Store) -> None:
    """Two schedulers' placements on one node: the database's guard holds even if placement erred."""
    await add_node(store, "n1", slots=4, max_operations=1)
    await placed(store)
    # a scheduler that believes the node has an operation free (a stale view) is refused by the row guard
    sched = Scheduler(store, DEFAULT_TIMING, server_id="stale")
    tid = await submit(store)
    plan = sched.dispatcher.plan(whole_window=True)
    begin = plan.begin
    plan.begin = lambda nodes, room, horizon, ops: begin(nodes, room, horizon, {})  # type: ignore[method-assign]
    out = await sched.store.dispatch(claim_limit=10, accept_seconds=15, lease_seconds=300, actor="stale", plan=plan)
    assert out.assigned == [] and out.lost_races == 1
    assert (await store.get_task(tid)).state == "queued"
