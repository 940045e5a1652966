"""Sandboxes against real PostgreSQL (embedded and 15): the failure class written by the statement
that ends an attempt, for every path of the policy; release proofs that free a container attempt's
capacity exactly once, and nothing else that does; the node view's "releasing"; inventories.

Node reports are applied the way the gateway applies them: the policy decides from the row just
read, and the store's compare-and-set (`transition_many`) writes it with the attempt's token and node.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from podium import failures, protocol, reasons
from podium.scheduler import policy
from podium.scheduler.apply import change, facts
from podium.scheduler.service import Scheduler
from podium.spec import TaskSpec
from podium.states import TaskState
from podium.store import Change, Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import node_row

S = TaskState
T = DEFAULT_TIMING
DIGEST = "sha256:" + "d" * 64


async def add_node(store: Store, node_id: str, *, slots: int = 4, egress: tuple[str, ...] = ("none", "open")) -> Any:
    row = await store.node_hello(
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels={}, capabilities=[],
        backends=["container", "process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[],
        cpu_millis=4000, memory_bytes=8 * 2**30, disk_bytes=10 * 2**30, gpus=0, slots=slots, gateway_id="test",
        agent_version="test", egress_contexts=egress, enforces_limits=True, max_operations=max(slots, 4),
    )  # fmt: skip
    assert row is not None
    return row


async def submit(store: Store, *, container: bool = False, **spec: Any) -> uuid.UUID:
    if container:
        spec.update(backend="container", image=f"registry.example.com/team/app@{DIGEST}")
    else:
        spec.setdefault("command", ["true"])
    row, _ = await store.submit(TaskSpec(**spec))
    if container:
        # what the resolver loop does for a tag (tested in test_resolver.py); here the image is pinned already
        assert await store.set_resolved([(row.id, DIGEST)]) == {row.id}
    return row.id


def scheduler(store: Store) -> Scheduler:
    return Scheduler(store, T, server_id="test")


async def placed(store: Store, tid: uuid.UUID) -> tuple[str, int]:
    """The task's node and token once assigned (placing it, with whatever else is queued, if it is not)."""
    row = await store.get_task(tid)
    if row.state == "queued":
        await scheduler(store).dispatch_once()
        row = await store.get_task(tid)
    assert row.state == "assigned", row
    return row.node_id, row.fencing_token


async def report(store: Store, tid: uuid.UUID, node: str, token: int, kind: str, exit_code: int | None = None, *,
                 failure_class: str = "", message: str = "", backend_ref: str = "") -> bool:  # fmt: skip
    """A node's report, decided and written as the gateway's group commit does it."""

    def decide(rows: Any) -> list[Change]:
        f = facts(rows[tid])
        step = policy.on_node_event(f, kind, exit_code, T, failure_class=failure_class, message=message)
        if step is None:
            return []
        return [change(tid, f.state, step, actor=f"node:{node}", fencing_token=token, node_id=node, backend_ref=backend_ref)]

    changes, done = await store.transition_decided([tid], decide)
    return bool(changes) and done[0] is not None


async def running(store: Store, tid: uuid.UUID, ref: str = "") -> tuple[str, int]:
    node, tok = await placed(store, tid)
    assert await report(store, tid, node, tok, protocol.PROVISIONING)
    assert await report(store, tid, node, tok, protocol.RUNNING, backend_ref=ref)
    return node, tok


async def attempts(store: Store, tid: uuid.UUID) -> list[Any]:
    return (await store.task_detail(tid))[1]


async def last_event(store: Store, tid: uuid.UUID) -> Any:
    return (await store.task_detail(tid))[2][-1]


async def slots(store: Store, node: str) -> int:
    return int((await node_row(store, node))["res_slots"])


# ---- failure classes ----------------------------------------------------------------------------------


async def _exit_nonzero(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    assert await report(store, tid, node, tok, protocol.EXITED, 3, message="Traceback: boom")


async def _oom(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    assert await report(store, tid, node, tok, protocol.EXITED, 137, failure_class="oom", message="OOMKilled: true")


async def _provisioning(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    assert await report(store, tid, node, tok, protocol.FAILED_RETRYABLE, failure_class="provisioning",
                        message="pull access denied")  # fmt: skip


async def _internal(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    assert await report(store, tid, node, tok, protocol.FAILED_RETRYABLE, message="disk full")


async def _timeout(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    sched = scheduler(store)
    row = await store.get_task(tid)
    assert await sched.applier.apply(tid, S.RUNNING, policy.on_cancel(facts(row), reasons.TIMEOUT), fencing_token=tok)
    assert await report(store, tid, node, tok, protocol.EXITED, 143)


async def _cancel(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    await scheduler(store).cancel(tid, actor="operator")
    assert await report(store, tid, node, tok, protocol.EXITED, 143)


async def _node_lost(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    row = await store.get_task(tid)
    assert await scheduler(store).applier.apply(tid, S.RUNNING, policy.on_node_loss(facts(row), reasons.NODE_LOST), fencing_token=tok)


async def _node_forgot(store: Store, tid: uuid.UUID, node: str, tok: int) -> None:
    assert await report(store, tid, node, tok, protocol.NOT_RUNNING)


PATHS = [
    # (path, how it ends, task state after, class, reason, detail)
    ("exit", _exit_nonzero, S.FAILED, failures.EXIT, reasons.EXITED_NONZERO, "Traceback: boom"),
    ("oom", _oom, S.FAILED, failures.OOM, reasons.OOM, "OOMKilled: true"),
    ("provisioning", _provisioning, S.QUEUED, failures.PROVISIONING, reasons.PROVISIONING_FAILED, "pull access denied"),
    ("internal", _internal, S.QUEUED, failures.INTERNAL, reasons.RETRYABLE_ERROR, "disk full"),
    ("timeout", _timeout, S.FAILED, failures.TIMEOUT, reasons.TIMEOUT, None),
    ("cancel", _cancel, S.CANCELLED, failures.CANCELLED, reasons.CANCELLED, None),
    ("node lost", _node_lost, S.QUEUED, failures.NODE_LOST, reasons.NODE_LOST, None),
    ("node forgot", _node_forgot, S.QUEUED, failures.NODE_LOST, reasons.NODE_FORGOT, None),
]


@pytest.mark.parametrize("end, to, cls, reason, detail", [p[1:] for p in PATHS], ids=[p[0] for p in PATHS])
async def test_each_end_writes_its_class_with_the_end(store: Store, end: Any, to: TaskState, cls: str, reason: str,
                                                     detail: str | None) -> None:  # fmt: skip
    await add_node(store, "n1")
    tid = await submit(store, max_attempts=2, timeout=3600)
    node, tok = await running(store, tid)
    (live,) = await attempts(store, tid)
    assert (live.failure_class, live.failure_detail, live.finished_at) == (None, None, None)
    await end(store, tid, node, tok)
    (a,) = await attempts(store, tid)
    task = await store.get_task(tid)
    ev = await last_event(store, tid)
    assert task.state == to and task.reason == reason
    # the class is on the attempt, in the event of the end, and the node's words beside the reason
    assert (a.failure_class, a.failure_detail, a.reason) == (cls, detail, reason)
    assert (ev.to_state, ev.failure_class, ev.detail, ev.reason) == (to, cls, detail, reason)
    assert task.reason_detail == detail
    assert a.released and a.finished_at is not None and await slots(store, "n1") == 0  # a process: freed with its end


async def test_accept_deadline_and_success_classes(store: Store) -> None:
    await add_node(store, "n1")
    late = await submit(store, max_attempts=1)
    node, tok = await placed(store, late)
    row = await store.get_task(late)
    assert await scheduler(store).applier.apply(late, S.ASSIGNED, policy.on_accept_overdue(facts(row)), fencing_token=tok)
    (a,) = await attempts(store, late)
    assert (a.state, a.failure_class, (await store.get_task(late)).reason) == ("revoked", "not_accepted", reasons.NOT_ACCEPTED)

    ok = await submit(store)
    node, tok = await running(store, ok)
    assert await report(store, ok, node, tok, protocol.EXITED, 0)
    (a,) = await attempts(store, ok)
    assert (a.state, a.failure_class, a.exit_code) == ("exited", None, 0)
    assert (await last_event(store, ok)).failure_class is None

    queued = await submit(store)
    await scheduler(store).cancel(queued, actor="operator")
    assert (await last_event(store, queued)).failure_class == "cancelled"


async def test_a_refused_end_writes_no_class(store: Store) -> None:
    """The class is part of the compare-and-set: a stale token or another node's report writes none."""
    await add_node(store, "n1")
    await add_node(store, "n2")
    tid = await submit(store)
    node, tok = await running(store, tid)
    other = "n2" if node == "n1" else "n1"
    assert not await report(store, tid, node, tok - 1, protocol.EXITED, 137, failure_class="oom", message="stale")
    assert not await report(store, tid, other, tok, protocol.EXITED, 137, failure_class="oom", message="foreign")
    (a,) = await attempts(store, tid)
    assert (a.state, a.failure_class, a.failure_detail) == ("running", None, None)
    assert (await store.get_task(tid)).state == "running"


# ---- release proofs --------------------------------------------------------------------------------


async def proof(store: Store, tid: uuid.UUID, token: int, node: str, ref: str) -> list[tuple[uuid.UUID, int, bool]]:
    return await store.release_proofs([(tid, token, node, ref, 1_700_000_000.5)])


async def releasing(store: Store, node: str) -> int:
    r = (await store.nodes_releasing([node])).get(node)
    return 0 if r is None else int(r.slots)


async def test_a_container_keeps_its_capacity_after_its_end_until_the_node_proves_it_removed(store: Store) -> None:
    await add_node(store, "n1", slots=1)
    await add_node(store, "n2", slots=1)
    tid = await submit(store, container=True, max_attempts=1)
    node, tok = await running(store, tid, ref="c0ffee")
    other = "n2" if node == "n1" else "n1"
    (a,) = await attempts(store, tid)
    assert (a.backend_kind, a.backend_ref) == ("container", "c0ffee")
    assert await report(store, tid, node, tok, protocol.EXITED, 0)
    (a,) = await attempts(store, tid)
    assert (await store.get_task(tid)).state == "succeeded" and a.finished_at is not None
    # an exit report alone frees nothing: the node shows the slot as releasing
    assert not a.released and await slots(store, node) == 1 and await releasing(store, node) == 1
    # a placement cannot use it
    nxt = await submit(store, container=True, home_node=node)
    out = await scheduler(store).dispatch_once()
    assert out.unplaced.get(nxt) == reasons.FULL

    # proofs that are not this attempt's are refused and change nothing
    assert await proof(store, tid, tok + 1000, node, "c0ffee") == []  # a made-up token
    assert await proof(store, tid, tok, other, "c0ffee") == []  # another node
    assert await proof(store, tid, tok, node, "deadbeef") == []  # another container
    assert await proof(store, uuid.uuid4(), tok, node, "c0ffee") == []  # another task
    assert await slots(store, node) == 1 and not (await attempts(store, tid))[0].released

    assert await proof(store, tid, tok, node, "c0ffee") == [(tid, tok, True)]
    (a,) = await attempts(store, tid)
    assert a.released and a.released_at is not None
    assert a.release_proof["by"] == "node" and a.release_proof["backend_ref"] == "c0ffee"
    assert a.release_proof["released_at"].startswith("2023-11-14T22:13:20.5")  # the node's clock, as sent
    assert await slots(store, node) == 0 and await releasing(store, node) == 0
    # a repeat is refused and harmless: capacity is given back once
    assert await proof(store, tid, tok, node, "c0ffee") == []
    n = await node_row(store, node)
    assert (n["res_slots"], n["res_cpu_millis"], n["res_memory_bytes"]) == (0, 0, 0)
    out = await scheduler(store).dispatch_once()
    assert [t for t, _n, _tok in out.assigned] == [nxt]


async def test_a_proof_before_the_end_releases_with_the_end(store: Store) -> None:
    """The proof and the end travel separately; whichever is recorded second frees the capacity."""
    await add_node(store, "n1", slots=2)
    tid = await submit(store, container=True)
    node, tok = await running(store, tid, ref="abc")
    assert await proof(store, tid, tok, node, "abc") == [(tid, tok, False)]
    assert await slots(store, node) == 1 and not (await attempts(store, tid))[0].released
    assert await report(store, tid, node, tok, protocol.EXITED, 1)
    (a,) = await attempts(store, tid)
    assert a.released and a.failure_class == "exit" and await slots(store, node) == 0


async def test_a_proof_racing_the_end_frees_the_capacity_exactly_once(store: Store) -> None:
    await add_node(store, "n1", slots=8)
    ids = [await submit(store, container=True) for _ in range(6)]
    where = {}
    out = await scheduler(store).dispatch_once()
    for tid, node, tok in out.assigned:
        where[tid] = (node, tok)
        assert await report(store, tid, node, tok, protocol.PROVISIONING)
        assert await report(store, tid, node, tok, protocol.RUNNING, backend_ref=f"c-{tok}")
    assert set(where) == set(ids) and await slots(store, "n1") == 6
    await asyncio.gather(*(
        coro for tid, (node, tok) in where.items()
        for coro in (report(store, tid, node, tok, protocol.EXITED, 0), proof(store, tid, tok, node, f"c-{tok}"),
                     proof(store, tid, tok, node, f"c-{tok}"))
    ))  # fmt: skip
    n = await node_row(store, "n1")
    assert (n["res_slots"], n["res_cpu_millis"], n["res_memory_bytes"]) == (0, 0, 0)
    for tid in ids:
        (a,) = await attempts(store, tid)
        assert a.released and a.release_proof["by"] == "node"


async def test_the_node_loss_policy_releases_without_a_proof_and_says_so(store: Store) -> None:
    await add_node(store, "n1", slots=4)
    ended = await submit(store, container=True)
    lost = await submit(store, container=True, max_attempts=1)
    expired = await submit(store, container=True, max_attempts=1)
    n_ended, tok_ended = await running(store, ended, ref="c1")
    n_lost, tok_lost = await running(store, lost, ref="c2")
    n_exp, tok_exp = await running(store, expired, ref="c3")
    assert await report(store, ended, n_ended, tok_ended, protocol.EXITED, 0)
    sched = scheduler(store)
    # a lease that expired on a node that still talks: its container may still be there
    row = await store.get_task(expired)
    assert await sched.applier.apply(expired, S.RUNNING, policy.on_node_loss(facts(row), reasons.LEASE_EXPIRED), fencing_token=tok_exp)
    assert await slots(store, "n1") == 3 and await releasing(store, "n1") == 2

    # the node goes offline: what ran there is lost, and everything it held is released
    async with store.pool.acquire() as c:
        await c.execute("UPDATE nodes SET last_heartbeat_at = now() - interval '1 hour'")
    await sched.sweep()
    (a_lost,) = await attempts(store, lost)
    assert (await store.get_task(lost)).state == "lost"
    assert a_lost.released and a_lost.release_proof == {"by": "server", "reason": reasons.NODE_LOST}
    assert a_lost.failure_class == "node_lost"
    for tid in (ended, expired):
        (a,) = await attempts(store, tid)
        assert a.released and a.release_proof == {"by": "server", "reason": reasons.NODE_LOST}, tid
    n = await node_row(store, "n1")
    assert (n["res_slots"], n["res_cpu_millis"], n["res_memory_bytes"]) == (0, 0, 0)
    # the node's proof, late, is refused and harmless
    assert await proof(store, ended, tok_ended, n_ended, "c1") == []
    assert await slots(store, "n1") == 0


async def test_a_removed_nodes_sandboxes_are_released_with_the_removal(store: Store) -> None:
    await add_node(store, "n1", slots=2)
    done = await submit(store, container=True)
    live = await submit(store, container=True, max_attempts=1)
    n1, tok1 = await running(store, done, ref="a")
    await running(store, live, ref="b")
    assert await report(store, done, n1, tok1, protocol.EXITED, 0)
    await store.revoke_node("n1")
    sched = scheduler(store)
    await sched.node_removed("n1")
    await sched.sweep()
    for tid in (done, live):
        (a,) = await attempts(store, tid)
        assert a.released and a.release_proof == {"by": "server", "reason": reasons.NODE_REVOKED}
    assert await slots(store, "n1") == 0


async def test_a_node_that_never_got_the_attempt_proves_it_by_saying_so(store: Store) -> None:
    """An assignment revoked before it started (never accepted) has no container to name: the
    node's "no such attempt here" is its proof. One that ran a container needs that container's."""
    await add_node(store, "n1", slots=2)
    tid = await submit(store, container=True, max_attempts=1)
    node, tok = await placed(store, tid)
    row = await store.get_task(tid)
    assert await scheduler(store).applier.apply(tid, S.ASSIGNED, policy.on_accept_overdue(facts(row)), fencing_token=tok)
    assert await slots(store, node) == 1 and await releasing(store, node) == 1
    assert await proof(store, tid, tok, node, "") == [(tid, tok, True)]
    assert await slots(store, node) == 0

    ran = await submit(store, container=True, max_attempts=1)
    node, tok = await running(store, ran, ref="c9")
    assert await report(store, ran, node, tok, protocol.EXITED, 0)
    assert await proof(store, ran, tok, node, "") == []  # it ran a container: the proof must name it
    assert await slots(store, node) == 1


async def test_a_process_attempt_is_released_with_its_end(store: Store) -> None:
    await add_node(store, "n1")
    tid = await submit(store)
    node, tok = await running(store, tid, ref="4242")
    assert (await attempts(store, tid))[0].backend_ref == "4242"
    assert await report(store, tid, node, tok, protocol.EXITED, 0)
    (a,) = await attempts(store, tid)
    assert a.released and a.release_proof is None and await slots(store, node) == 0
    assert await proof(store, tid, tok, node, "4242") == []  # nothing to prove for a process


async def test_a_retried_container_task_waits_for_its_old_sandbox_on_a_full_node(store: Store) -> None:
    """Requeued after a failure while its first container is still being removed: on a one-slot node
    the retry waits until the proof, then runs."""
    await add_node(store, "n1", slots=1)
    tid = await submit(store, container=True, max_attempts=2)
    node, tok = await running(store, tid, ref="first")
    assert await report(store, tid, node, tok, protocol.FAILED_RETRYABLE, failure_class="provisioning", message="create failed")
    assert (await store.get_task(tid)).state == "queued"
    out = await scheduler(store).dispatch_once()
    assert out.assigned == [] and out.unplaced == {tid: reasons.FULL}
    assert await proof(store, tid, tok, node, "first") == [(tid, tok, True)]
    node2, tok2 = await placed(store, tid)
    assert tok2 > tok
    first, second = await attempts(store, tid)
    assert first.released and not second.released and first.failure_class == "provisioning"


# ---- nodes: egress contexts, limits, inventories ------------------------------------------------------------


async def test_a_node_stores_what_its_sandboxes_can_give(store: Store) -> None:
    row = await add_node(store, "n1", egress=("none", "open"))
    n = await node_row(store, "n1")
    assert (list(n["egress_contexts"]), n["enforces_limits"]) == (["none", "open"], True)
    await store.node_hello(
        node_id="n1", name="n1", pool="default", arch="x86_64", labels={}, capabilities=[], backends=["process"],
        artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[], cpu_millis=1, memory_bytes=1, disk_bytes=1,
        gpus=0, slots=1, gateway_id="test", agent_version="old",
    )  # fmt: skip
    n = await node_row(store, "n1")
    assert (list(n["egress_contexts"]), n["enforces_limits"]) == (["open"], False)  # an agent that says nothing
    assert row.session + 1 == n["session"]


async def test_egress_is_placed_on_a_node_that_can_give_it(store: Store) -> None:
    await add_node(store, "open", egress=("open",))
    none = await submit(store, container=True, egress="none")
    out = await scheduler(store).dispatch_once()
    assert out.unplaced == {none: reasons.NO_EGRESS}
    assert (await store.get_task(none)).reason == reasons.NO_EGRESS
    await add_node(store, "isolating", egress=("none", "open"))
    assert (await placed(store, none))[0] == "isolating"


async def test_an_inventory_moves_placement_to_the_node_holding_the_digest(store: Store) -> None:
    a = await add_node(store, "a")
    await add_node(store, "b")
    assert await store.set_artifacts("a", a.session, [DIGEST, "sha256:" + "e" * 64])
    assert not await store.set_artifacts("a", a.session - 1, [])  # an old session writes nothing
    assert not await store.set_artifacts("a", a.session, [DIGEST, "sha256:" + "e" * 64])  # nothing changed
    assert list((await node_row(store, "a"))["artifacts"]) == sorted([DIGEST, "sha256:" + "e" * 64])
    # b is emptier, but a holds the image: locality first
    first = await submit(store, container=True)
    assert (await placed(store, first))[0] == "a"
    plain = await submit(store)
    assert (await placed(store, plain))[0] == "b"


async def test_pruning_keeps_a_task_whose_sandbox_still_holds_capacity(store: Store) -> None:
    await add_node(store, "n1", slots=2)
    held = await submit(store, container=True)
    freed = await submit(store, container=True)
    for tid, ref in ((held, "h"), (freed, "f")):
        node, tok = await running(store, tid, ref=ref)
        assert await report(store, tid, node, tok, protocol.EXITED, 0)
    assert await proof(store, freed, (await store.get_task(freed)).fencing_token, "n1", "f")
    async with store.pool.acquire() as c:
        await c.execute("UPDATE tasks SET finished_at = now() - interval '30 days'")
    assert await store.prune_finished(86400, 100) == 1
    assert (await store.get_task(held)).state == "succeeded"
    assert await slots(store, "n1") == 1  # still accounted for by the attempt that will release it
