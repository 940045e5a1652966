"""Two group commits of node reports at once (`ReportBatcher.loop`): a second one is begun only while
a commit is being applied and SECOND_COMMIT_BACKLOG reports wait behind it, never holds a task of
the first, and a task's later report waits for the commit of its earlier one. Real PostgreSQL; the
gateway's own batcher; the node's stream stood in for by the gateway's `Session`. The first commit
is held open by a gate around the store's statement for acceptances, so what runs beside it is seen."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from podium.gateway.liveness import LogFlusher
from podium.gateway.reports import SECOND_COMMIT_BACKLOG, ReportBatcher
from podium.gateway.sessions import Session, Sessions
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.spec import TaskSpec
from podium.states import TaskState as S
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node, looping, place, until

K = pb.TaskEvent.Kind


async def _assigned_on_n1(store: Store, n: int) -> list[tuple[uuid.UUID, int]]:
    """`n` tasks assigned to a new node "n1" with room for all of them: (id, fencing token) each."""
    await add_node(store, "n1", slots=n, cpu=n * 1000, memory=n * 2**30)
    rows = await store.submit_many([(TaskSpec(command=["true"]), None) for _ in range(n)], actor="test")
    await place(store)
    out = []
    for row, _created in rows:
        t = await store.get_task(row.id)
        assert t.state == S.ASSIGNED and t.node_id == "n1" and t.fencing_token is not None
        out.append((t.id, t.fencing_token))
    return out


class _Gate:
    """Around the store's two statements for node reports: the first call of `transition_expected`
    (the acceptances') waits until `open` is set; every call's tasks are recorded (`calls`, the
    acceptances'; `beside`, any made while the first was held), with how many acceptance statements
    were under way at its start."""

    def __init__(self, store: Store) -> None:
        self.expected, self.decided = store.transition_expected, store.transition_decided
        self.open = asyncio.Event()
        self.calls: list[tuple[set[uuid.UUID], int]] = []
        self.beside: set[uuid.UUID] = set()
        self.under_way = 0

    async def transition_expected(self, changes: Sequence[Any]) -> Any:
        tasks = {c.task_id for c in changes}
        self.calls.append((tasks, self.under_way))
        if self.calls[1:] and not self.open.is_set():
            self.beside |= tasks
        self.under_way += 1
        try:
            if len(self.calls) == 1:
                await self.open.wait()
            return await self.expected(changes)
        finally:
            self.under_way -= 1

    async def transition_decided(self, task_ids: Sequence[uuid.UUID], *args: Any, **kwargs: Any) -> Any:
        if not self.open.is_set():
            self.beside |= set(task_ids)
        return await self.decided(task_ids, *args, **kwargs)


def _report(tid: uuid.UUID, tok: int, kind: int) -> pb.TaskEvent:
    return pb.TaskEvent(task_id=str(tid), fencing_token=tok, kind=kind)


async def test_a_second_commit_begins_only_behind_a_backlog_and_never_holds_a_task_of_the_first(store: Store) -> None:
    # acceptances waiting behind the first commit: with the first task's start, one report short of
    # a second commit
    held = SECOND_COMMIT_BACKLOG - 2
    tasks = await _assigned_on_n1(store, 1 + held + 1)
    first, waiting, last = tasks[0], tasks[1 : 1 + held], tasks[-1]
    sessions = Sessions()
    s = sessions["n1"] = Session("n1", 1)
    gate = _Gate(store)
    store.transition_expected = gate.transition_expected  # type: ignore[method-assign]
    store.transition_decided = gate.transition_decided  # type: ignore[method-assign]
    batcher = ReportBatcher(store, sessions, DEFAULT_TIMING, logs=LogFlusher(store, sessions))
    try:
        async with looping(batcher.loop()):
            await batcher.enqueue(s, _report(*first, K.PROVISIONING))
            await until(lambda: len(gate.calls) == 1, "the first commit's acceptance statement")
            # the first task's start, sent behind its acceptance, and one report fewer than a second
            # commit needs: nothing more is begun while the first commit is under way
            await batcher.enqueue(s, _report(*first, K.RUNNING))
            for tid, tok in waiting:
                await batcher.enqueue(s, _report(tid, tok, K.PROVISIONING))
            await asyncio.sleep(0.05)
            assert len(gate.calls) == 1 and batcher.backlog == SECOND_COMMIT_BACKLOG - 1
            # one more: a second commit begins beside the first, with every acceptance waiting and
            # without the first task's start, which waits for the commit of its acceptance
            await batcher.enqueue(s, _report(*last, K.PROVISIONING))
            await until(lambda: len(gate.calls) == 2, "a second commit beside the first")
            second, under_way = gate.calls[1]
            assert under_way == 1, "the second commit began while the first was under way"
            assert second == {t for t, _ in waiting} | {last[0]}
            await until(lambda: gate.under_way == 1, "the second commit's acceptances made")
            assert first[0] not in gate.beside, "the first task's start was taken while its acceptance was under way"
            await until(lambda: batcher.backlog == 1, "the second commit made, the first task's start left waiting")
            gate.open.set()
            await until(lambda: s.out.qsize() == len(tasks), "an Accepted for every task")
            # the first task's start, made after its acceptance was committed (by a read)
            deadline = asyncio.get_running_loop().time() + 30
            while (await store.get_task(first[0])).state != S.RUNNING:
                assert asyncio.get_running_loop().time() < deadline, "the first task's start was not made"
                await asyncio.sleep(0.01)
    finally:
        del store.transition_expected, store.transition_decided
    assert batcher.backlog == 0
    for tid, _tok in [*waiting, last]:
        assert (await store.get_task(tid)).state == S.PROVISIONING
    accepted = []
    while not s.out.empty():
        m = s.out.get_nowait()
        assert m is not None and m.WhichOneof("kind") == "accepted"
        accepted.append(uuid.UUID(m.accepted.task_id))
    assert sorted(accepted) == sorted(t for t, _ in tasks)
