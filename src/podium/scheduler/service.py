"""The scheduler as the rest of the server sees it: its two loops (`dispatch`, `watchdog`) wired to one
applier, and the operator's actions on placement — explain, check, cancel, a node removed.

Neither this module nor the loops it wires ever transition a task from what a session believes in
memory: every change is the policy's Step applied as a compare-and-set in the store with the `from`
just read (`scheduler.apply`), and every time is the database's `now()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from podium import reasons
from podium.errors import Contention, PreconditionFailed
from podium.placement import NodeSnapshot, NodeVerdict, Resources, explain
from podium.scheduler import policy
from podium.scheduler.apply import Applier, facts
from podium.scheduler.dispatch import Dispatcher, EarlyPush, node_snapshot, requirements
from podium.scheduler.watchdog import DEFAULT_RETENTION, Watchdog
from podium.spec import TaskSpec
from podium.store import Store
from podium.store.db import DispatchOutcome
from podium.store.reconcile import ReconcileStore
from podium.store.rows import NodeRow, OutboxRow, TaskRow
from podium.timing import Timing

log = logging.getLogger(__name__)

# Seconds a handler waits for the pass it handed its submission to before it stores it itself (the
# same ids: the pass's commit, if it came, is found). A pass takes milliseconds; this only bounds a
# dispatcher stopped with the submission in hand.
HANDED_WAIT = 10.0


class Scheduler:
    def __init__(
        self,
        store: Store,
        timing: Timing,
        *,
        server_id: str,
        policy_name: str = "spread",
        retention: float = DEFAULT_RETENTION,
        dispatch_store: Store | None = None,
    ) -> None:
        """`dispatch_store`: the pool the dispatch passes run on (the server gives them a keyed one of
        their own, `Store.connect(keyed=True)`); `store` when none is given."""
        self.store = store
        self.timing = timing
        self.server_id = server_id
        self.policy_name = policy_name
        self.actor = f"scheduler:{server_id}"
        self.applier = Applier(store, actor=self.actor)
        self.dispatcher = Dispatcher(dispatch_store or store, timing, actor=self.actor, policy_name=policy_name)
        self.watchdog = Watchdog(store, timing, self.applier, retention=retention)

    def hold_while_behind(self, behind: Callable[[], float]) -> None:
        """Hold new placements while this server's gateway is behind (on recording node reports, or on
        writing to the streams) by more than a share of the accept deadline (`dispatch.HOLD_SHARE`);
        `behind` says by how many seconds (`Gateway.behind`). Given once the gateway exists (it is
        built after the scheduler)."""
        self.dispatcher.behind = behind

    def deliver_through(
        self, streams_here: Callable[[], Collection[str]], push: Callable[[list[OutboxRow]], None],
        early: EarlyPush | None = None,
    ) -> None:  # fmt: skip
        """Assigns for the nodes whose streams this server holds (`streams_here`) are marked delivered
        by the dispatch that places them and handed to `push` (the gateway's outbox) once it commits:
        no NOTIFY and no outbox take between a placement and its Assign. Other nodes' go by NOTIFY.
        With `early` (the gateway), they are first offered to it before the COMMIT is sent; what it
        takes is not pushed again."""
        self.dispatcher.streams_here = streams_here
        self.dispatcher.push = push
        self.dispatcher.early = early

    # ---- running ----------------------------------------------------------------------------------

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """The named loops the server supervises."""
        return {"scheduler.dispatch": self.dispatcher.loop.run, "scheduler.watchdog": self.watchdog.loop}

    async def close(self) -> None:
        self.dispatcher.refills = False  # no commit of ends places anything once the loop is stopping
        self.dispatcher.release_handed()  # its loop is stopped: what it held goes back to the handlers
        await self.dispatcher.loop.close()

    async def submit_many(self, items: list[tuple[TaskSpec, str | None]], *, actor: str) -> list[tuple[TaskRow, bool]]:
        """Store submissions (`Store.submit_many`'s answers). Without idempotency keys and with this
        server's dispatcher idle, they are handed to it: its pass stores them and places them in
        one transaction. Otherwise (a key may conflict and refuse the batch: not inside a pass that
        places others' tasks too), or when the pass did not store them, they are stored here."""
        if any(key is not None for _spec, key in items):
            return await self.store.submit_many(items, actor=actor)
        sub = self.store.submissions(items, actor=actor)
        handed = self.dispatcher.take_submission(sub)
        if handed is not None:
            stored = None
            try:
                # not wait_for, which in Python 3.11 returns the answer of a pass that ends in the turn
                # this request is cancelled (its client gone), and loses the cancel
                async with asyncio.timeout(HANDED_WAIT):
                    stored = await handed
            except TimeoutError:
                log.warning("a dispatch pass given %d new tasks did not answer within %gs; storing them on their own",
                            len(items), HANDED_WAIT)  # fmt: skip
            except Exception as e:
                log.warning("a dispatch pass given %d new tasks failed (%s); storing them on their own", len(items), e)
            if stored is not None:
                return [(stored[i], True) for i in sub.ids]
        return await self.store.submit_many(items, actor=actor, ids=sub.ids)

    async def dispatch_once(self) -> DispatchOutcome:
        return await self.dispatcher.dispatch_once()

    async def sweep(self) -> None:
        await self.watchdog.sweep()

    # ---- operator actions ---------------------------------------------------------------------

    async def explain(
        self, task_id: uuid.UUID
    ) -> tuple[TaskRow, list[tuple[NodeVerdict, NodeRow | None]], frozenset[str]]:
        """Why is this task where it is: every node with the first check it fails for the task, or
        its score. Nodes that are not connected are listed too (they fail the first check)."""
        task = await self.store.get_task(task_id)
        nodes = await self.store.placement_nodes()
        everyone = {r.id: r for r in await self.store.list_nodes()}
        avoid = [a.node_id for a in (await self.store.task_detail(task_id))[1] if a.state in ("revoked", "lost", "failed")]
        req = requirements(
            task.spec, task.cpu_millis, task.memory_bytes, task.disk_bytes, task.gpus, avoid, task.image_digest
        )
        ops = await ReconcileStore(self.store).operations_in_flight()
        snaps = [dataclasses.replace(node_snapshot(n), operations=ops.get(n.id, 0)) for n in nodes]
        connected = {n.id for n in snaps}
        for nid, row in everyone.items():
            if nid not in connected:
                snaps.append(NodeSnapshot(id=nid, name=row.name, connected=False, health=row.health))
        verdicts = explain(req, snaps, policy=self.policy_name)
        return task, [(v, everyone.get(v.node_id)) for v in verdicts], req.avoid_nodes

    async def check(self, spec: dict[str, Any], cpu: int, memory: int, disk: int, gpus: int) -> list[tuple[NodeVerdict, NodeRow]]:
        """Could any node of the fleet ever run this spec? Hard compatibility only (pool, arch,
        backend, protocol, labels, capabilities, too large): every node that is not removed is
        judged as if it were online, undrained and empty, since connections, health, drains and
        what is free now all change. Reads only; stores nothing."""
        rows = {r.id: r for r in await self.store.list_nodes() if r.revoked_at is None}
        req = requirements(spec, cpu, memory, disk, gpus)
        empty = Resources(0, 0, 0, 0, 0)
        snaps = [
            dataclasses.replace(
                node_snapshot(dataclasses.replace(r, gpus_in_use=[])), connected=True, health="online", draining=False,
                reserved=empty,
            )
            for r in rows.values()
        ]
        return [(v, rows[v.node_id]) for v in explain(req, snaps, policy=self.policy_name)]

    async def node_removed(self, node_id: str) -> None:
        """A node was removed from the fleet: its tasks go through the node-loss policy now, not
        after OfflineAfter — it will never report again."""
        for r in await self.store.tasks_on_node(node_id):
            row = await self.store.get_task(r.id)
            f = facts(row)
            await self.applier.apply(r.id, f.state, policy.on_node_loss(f, reasons.NODE_REVOKED), fencing_token=r.fencing_token)

    async def cancel(self, task_id: uuid.UUID, actor: str, if_revision: int | None = None) -> TaskRow:
        """Cancel a task: a queued one ends at once; one on a node is told to stop. Retries the
        compare-and-set when the task moved underneath (e.g. it was placed in between). With
        `if_revision`, only while the task is still at that assignment revision (checked in the
        compare-and-set itself): otherwise PreconditionFailed, naming both revisions."""
        for _ in range(10):
            row = await self.store.get_task(task_id)
            if if_revision is not None and row.revision != if_revision:
                raise PreconditionFailed(
                    f"task {task_id} is at revision {row.revision}, not revision {if_revision} as this request "
                    f"expects (it is {row.state} now); read it again (`podium show {task_id}`) and decide again"
                )
            f = facts(row)
            step = policy.on_cancel(f)
            if step is None:
                return row  # already ended or already being cancelled: nothing to do
            if await self.applier.apply(task_id, f.state, step, actor=actor, fencing_token=row.fencing_token, revision=if_revision):
                return await self.store.get_task(task_id)
        # the task kept moving between the read and the compare-and-set: contention, not a missing task
        raise Contention(f"task {task_id} kept changing state while it was being cancelled; nothing was written, try again")
