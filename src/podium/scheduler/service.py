"""The scheduler's two loops, deliberately separate:

- the dispatch tick claims queued tasks and places them, woken by its own ticker or by the database
  saying something placement cares about changed (a task queued, room freed, a node joined);
- the watchdog sweep applies the deadlines to every task a node owes an answer for — the accept
  deadline, the spec's timeout, the operator's cancel, the lease — and turns node silence into
  `unreachable`, then `offline` and the node-loss policy.

Neither ever transitions a task from what a session believes in memory: every change is a
compare-and-set in the store with the `from` just read, and every time is the database's `now()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from podium import metrics, reasons
from podium.errors import NotFound, PreconditionFailed, StoreUnavailable
from podium.placement import NodeSnapshot, NodeVerdict, Placer, Requirements, Resources, Unplaceable, explain
from podium.scheduler import policy
from podium.scheduler.policy import Step, TaskFacts
from podium.states import TaskState
from podium.store import Store, Transition
from podium.store.db import CONNECTION_ERRORS, DispatchOutcome, PlacementDecision
from podium.store.reconcile import ReconcileStore
from podium.timing import Timing

log = logging.getLogger(__name__)

SWEEP_LIMIT = 1000  # rows one watchdog query looks at; the next sweep takes the rest
WINDOW_POLL = 0.02  # seconds between looks at a full assignment window
FULL_NODE_READ_EVERY = 60.0  # seconds between reads of every node row (in between: changed rows only)
PRUNE_EVERY = 60.0  # seconds between deletions of tasks older than the retention
PRUNE_BATCH = 5000  # tasks deleted at most per pass, so one pass never holds locks for long
DEFAULT_RETENTION = 7 * 86400.0  # seconds a finished task, its events and its logs are kept


def facts(row: asyncpg.Record | dict[str, Any]) -> TaskFacts:
    get = row.get if isinstance(row, dict) else (lambda k, d=None: row[k] if k in row.keys() else d)  # noqa: E731
    return TaskFacts(
        state=TaskState(get("state")),
        attempts=get("attempts", 1) or 0,
        max_attempts=get("max_attempts", 1) or 1,
        requeue_on_node_loss=bool(get("requeue_on_node_loss", True)),
        timeout=get("timeout_seconds"),
        cancel_reason=get("cancel_reason"),
    )


def node_snapshot(row: asyncpg.Record) -> NodeSnapshot:
    in_use = set(row["gpus_in_use"] or ())
    return NodeSnapshot(
        id=row["id"],
        name=row["name"],
        connected=row["connected"],
        health=row["health"],
        draining=row["draining"],
        pool=row["pool"],
        arch=row["arch"],
        labels=row["labels"],
        capabilities=frozenset(row["capabilities"]),
        backends=frozenset(row["backends"]),
        protocol_min=row["protocol_min"],
        protocol_max=row["protocol_max"],
        allocatable=Resources(
            row["alloc_cpu_millis"], row["alloc_memory_bytes"], row["alloc_disk_bytes"], row["alloc_gpus"], row["alloc_slots"]
        ),
        reserved=Resources(
            row["res_cpu_millis"], row["res_memory_bytes"], row["res_disk_bytes"], row["res_gpus"], row["res_slots"]
        ),
        artifacts=frozenset(row["artifacts"]),
        gpu_free=tuple(g for g in sorted(row["gpu_indexes"]) if g not in in_use),
        egress_contexts=frozenset(row["egress_contexts"]),
        max_operations=row["max_operations"],
    )


def with_operations(snaps: dict[str, NodeSnapshot], operations: dict[str, int]) -> dict[str, NodeSnapshot]:
    """The snapshots with each node's provisioning operations as counted now. A node row does not
    change when an attempt starts running, so the count is read every tick rather than kept."""
    out = snaps
    for nid, snap in snaps.items():
        now = operations.get(nid, 0)
        if snap.operations != now:
            if out is snaps:
                out = dict(snaps)
            out[nid] = dataclasses.replace(snap, operations=now)
    return out


def requirements(
    spec: dict[str, Any], cpu: int, memory: int, disk: int, gpus: int, avoid: list[str] | None = None,
    image_digest: str | None = None,
) -> Requirements:
    # A node already holding the digest the task's image was pinned to comes first (locality).
    preferred = tuple(spec.get("preferred_artifacts") or ())
    if image_digest and image_digest not in preferred:
        preferred = (image_digest, *preferred)
    return Requirements(
        resources=Resources(cpu, memory, disk, gpus, 1),
        labels=spec.get("labels") or {},
        pool=spec.get("pool"),
        arch=spec.get("arch"),
        capabilities=frozenset(spec.get("capabilities") or ()),
        backend=spec.get("backend", "process"),
        protocol=spec.get("protocol", 1),
        preferred_artifacts=preferred,
        home_node=spec.get("home_node"),
        avoid_nodes=frozenset(avoid or ()),
        egress=spec.get("egress"),
    )


class Scheduler:
    def __init__(
        self, store: Store, timing: Timing, *, server_id: str, policy_name: str = "spread", retention: float = DEFAULT_RETENTION
    ) -> None:
        self.store = store
        self.retention = retention
        self._last_prune = 0.0
        self.timing = timing
        self.server_id = server_id
        self.policy_name = policy_name
        self.actor = f"scheduler:{server_id}"
        self._wake = asyncio.Event()
        self._listen_conn: asyncpg.Connection | None = None
        self.placed_total = 0
        # What placement knows of the connected nodes between ticks, and the snapshot horizon of the
        # read that brought it up to date (None: read them all next time).
        self._snaps: dict[str, NodeSnapshot] = {}
        self._horizon: int | None = None
        self._nodes_read_all_at = float("-inf")

    # ---- running ----------------------------------------------------------------------------------

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """The named loops the server supervises."""
        return {"scheduler.dispatch": self.dispatch_loop, "scheduler.watchdog": self.watchdog_loop}

    def wake(self) -> None:
        self._wake.set()

    async def _ensure_listening(self) -> None:
        if self._listen_conn is None or self._listen_conn.is_closed():
            self._listen_conn = await self.store.listen("podium_dispatch", lambda _p: self._wake.set())

    async def close(self) -> None:
        if self._listen_conn is not None and not self._listen_conn.is_closed():
            await self._listen_conn.close()

    async def dispatch_loop(self) -> None:
        while True:
            try:
                await self._ensure_listening()
                outcome = await self.dispatch_once()
                if outcome.window_full:
                    # Nodes are behind on accepting what they were given; nothing wakes us when they
                    # catch up, so look again soon rather than at the next tick.
                    await asyncio.sleep(min(self.timing.tick, WINDOW_POLL))
                    continue
                full = outcome.claimed >= outcome.limit and outcome.assigned
                if full:
                    continue  # more may be waiting: don't sleep between full batches
            except StoreUnavailable as e:
                log.warning("dispatch: %s; retrying", e)
                self._listen_conn = None
            except CONNECTION_ERRORS as e:
                log.warning("dispatch: lost the database (%s); retrying", e)
                self._listen_conn = None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.timing.tick)
            except TimeoutError:
                pass
            self._wake.clear()

    async def dispatch_once(self) -> Any:
        in_flight = await self.store.assigned_in_flight(self.timing.assign_window)
        limit = min(self.timing.claim_limit, self.timing.assign_window - in_flight)
        if limit <= 0:
            metrics.DISPATCH_WINDOW_FULL.inc()
            return DispatchOutcome(window_full=True)
        with metrics.DISPATCH_SECONDS.time():
            outcome = await self._dispatch(limit)
        self.placed_total += len(outcome.assigned)
        metrics.PLACEMENTS.inc(len(outcome.assigned))
        outcome.limit = limit
        return outcome

    async def _dispatch(self, limit: int) -> DispatchOutcome:
        now = asyncio.get_running_loop().time()
        if now - self._nodes_read_all_at > FULL_NODE_READ_EVERY:
            self._horizon = None  # read every node again now and then: cheap insurance
        return await self.store.dispatch(
            claim_limit=limit,
            accept_seconds=self.timing.provisioning_deadline,
            lease_seconds=self.timing.lease_ttl,
            decide=self.decide,
            actor=self.actor,
            nodes_since=self._horizon,
            reconcile_seconds=self.timing.reconcile,
        )

    def _remember_nodes(self, changed: list[asyncpg.Record], horizon: int) -> None:
        """Fold the node rows changed since the last read into the snapshots kept between ticks."""
        if self._horizon is None:
            self._snaps = {}
            self._nodes_read_all_at = asyncio.get_running_loop().time()
        for row in changed:
            if row["connected"] and row["revoked_at"] is None:
                self._snaps[row["id"]] = node_snapshot(row)
            else:
                self._snaps.pop(row["id"], None)
        self._horizon = horizon

    def decide(
        self, tasks: list[asyncpg.Record], changed: list[asyncpg.Record], horizon: int, operations: dict[str, int] | None = None
    ) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        """Pure once the rows are read: the Placer sees every connected node (kept between ticks,
        with the rows changed since the last read folded in, and the provisioning operations each
        runs now) and reserves as it goes."""
        self._remember_nodes(changed, horizon)
        if operations is not None:
            self._snaps = with_operations(self._snaps, operations)
        placer = Placer([self._snaps[k] for k in sorted(self._snaps)], policy=self.policy_name)
        placed: list[PlacementDecision] = []
        unplaced: dict[uuid.UUID, str] = {}
        for t in tasks:
            req = requirements(
                t["spec"], t["cpu_millis"], t["memory_bytes"], t["disk_bytes"], t["gpus"], t["avoid"], t["image_digest"]
            )
            result = placer.place(req)
            if isinstance(result, Unplaceable):
                unplaced[t["id"]] = result.reason
            else:
                placed.append(
                    PlacementDecision(
                        t["id"], result.node_id, t["cpu_millis"], t["memory_bytes"], t["disk_bytes"], t["gpus"], result.gpu_indexes,
                        self._snaps[result.node_id].capability_snapshot(),
                    )
                )
        return placed, unplaced

    async def watchdog_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.sweep()
                if loop.time() - self._last_prune > PRUNE_EVERY:
                    self._last_prune = loop.time()
                    pruned = await self.store.prune_finished(self.retention, PRUNE_BATCH)
                    if pruned:
                        log.info("pruned %d tasks finished more than %.0fs ago", pruned, self.retention)
            except StoreUnavailable as e:
                log.warning("watchdog: %s; retrying", e)
            except CONNECTION_ERRORS as e:
                log.warning("watchdog: lost the database (%s); retrying", e)
            await asyncio.sleep(self.timing.watchdog)

    # ---- applying decisions -------------------------------------------------------------------

    async def apply(
        self,
        task_id: uuid.UUID,
        from_: TaskState,
        step: Step | None,
        *,
        actor: str | None = None,
        fencing_token: int | None = None,
        node_id: str | None = None,
        revision: int | None = None,
    ) -> Transition | None:
        if step is None:
            return None
        result = await self.store.transition_task(
            task_id,
            from_,
            step.to,
            actor=actor or self.actor,
            reason=step.reason,
            fencing_token=fencing_token,
            node_id=node_id,
            exit_code=step.exit_code,
            lease_seconds=step.lease_seconds,
            end_attempt=step.end_attempt,
            attempt_state=step.attempt_state,
            stop=step.stop,
            failure_class=step.failure_class,
            detail=step.detail,
            release=step.release,
            revision=revision,
        )
        if result is not None:
            log.debug("task %s: %s → %s (%s)", task_id, from_, step.to, step.reason or "-")
        return result

    async def sweep(self) -> None:
        """One pass of the watchdog. Each query reads candidates by the database clock; each change
        is a compare-and-set from the state just read, so a late node event or another server's sweep
        racing this one makes it a no-op, never a second transition."""
        t = self.timing
        unreachable = await self.store.mark_unreachable(t.unreachable_after)
        for node in unreachable:
            log.warning("node %s is unreachable: no heartbeat for %.1fs; its tasks keep running", node, t.unreachable_after)
        offline = await self.store.mark_offline(t.offline_after)
        for node in offline:
            log.warning("node %s is offline: no heartbeat for %.1fs; its leases expire", node, t.offline_after)

        for row in await self.store.lost_tasks(SWEEP_LIMIT):
            why = {"offline": reasons.NODE_LOST, "revoked": reasons.NODE_REVOKED, "lease": reasons.LEASE_EXPIRED}.get(row["why"])
            f = facts(row)
            if why is None:  # on no node and holding no lease: an invariant broken somewhere
                step: Step | None = policy.on_invariant_broken()
            else:
                step = policy.on_node_loss(f, why)
            await self.apply(row["id"], f.state, step, fencing_token=row["fencing_token"])

        # Attempts a node's new agent instance did not report, once the instance it superseded has
        # certainly stopped them (its fence deadline passed): only now may they run elsewhere.
        for row in await self.store.handover_due(SWEEP_LIMIT):
            f = facts(row)
            done = await self.apply(row["id"], f.state, policy.on_node_loss(f, reasons.INSTANCE_REPLACED), fencing_token=row["fencing_token"])
            if done is not None:
                await self.store.node_event(
                    row["node_id"], "handover", f"task {row['id']} (attempt token {row['fencing_token']}): {reasons.INSTANCE_REPLACED}",
                    {"task": str(row["id"]), "fencing_token": row["fencing_token"]},
                )  # fmt: skip
        await self.store.handover_done()

        # Container attempts that ended on a node the node-loss policy has now given up on will never
        # get their release proof: release them, with a proof that says so.
        for r in await self.store.release_abandoned(SWEEP_LIMIT):
            log.info("attempt %d of task %s on node %s: released without a proof (its node is gone)",
                     r["fencing_token"], r["task_id"], r["node_id"])  # fmt: skip

        # A drain's deadline passed: what still runs on the node goes through the node-loss policy
        # (requeued if the spec allows it and attempts remain, else lost; docs/decisions.md), each a
        # compare-and-set from the state and attempt just read.
        for row in await self.store.drain_overdue(SWEEP_LIMIT):
            f = facts(row)
            done = await self.apply(row["id"], f.state, policy.on_node_loss(f, reasons.DRAIN_DEADLINE), fencing_token=row["fencing_token"])
            if done is not None:
                await self.store.node_event(
                    row["node_id"], "drain", f"task {row['id']} (attempt token {row['fencing_token']}): {reasons.DRAIN_DEADLINE}",
                    {"task": str(row["id"]), "fencing_token": row["fencing_token"]},
                )  # fmt: skip

        for row in await self.store.overdue_accepts(SWEEP_LIMIT):
            f = facts(row)
            await self.apply(row["id"], f.state, policy.on_accept_overdue(f), fencing_token=row["fencing_token"])

        for row in await self.store.timed_out(SWEEP_LIMIT):
            f = facts(row)
            await self.apply(row["id"], f.state, policy.on_cancel(f, reasons.TIMEOUT), fencing_token=row["fencing_token"])

        for row in await self.store.cancel_grace_expired(t.cancel_grace, SWEEP_LIMIT):
            f = facts(row)
            await self.apply(row["id"], f.state, policy.on_cancel_grace(f), fencing_token=row["fencing_token"])

    # ---- operator actions ---------------------------------------------------------------------

    async def explain(
        self, task_id: uuid.UUID
    ) -> tuple[asyncpg.Record, list[tuple[NodeVerdict, asyncpg.Record | None]], frozenset[str]]:
        """Why is this task where it is: every node with the first check it fails for the task, or
        its score. Nodes that are not connected are listed too (they fail the first check)."""
        task = await self.store.get_task(task_id)
        nodes = await self.store.placement_nodes()
        everyone = {r["id"]: r for r in await self.store.list_nodes()}
        avoid = [a["node_id"] for a in (await self.store.task_detail(task_id))[1] if a["state"] in ("revoked", "lost", "failed")]
        req = requirements(
            task["spec"], task["cpu_millis"], task["memory_bytes"], task["disk_bytes"], task["gpus"], avoid, task["image_digest"]
        )
        ops = await ReconcileStore(self.store).operations_in_flight()
        snaps = [dataclasses.replace(node_snapshot(n), operations=ops.get(n["id"], 0)) for n in nodes]
        connected = {n.id for n in snaps}
        for nid, row in everyone.items():
            if nid not in connected:
                snaps.append(NodeSnapshot(id=nid, name=row["name"], connected=False, health=row["health"]))
        verdicts = explain(req, snaps, policy=self.policy_name)
        return task, [(v, everyone.get(v.node_id)) for v in verdicts], req.avoid_nodes

    async def check(self, spec: dict[str, Any], cpu: int, memory: int, disk: int, gpus: int) -> list[tuple[NodeVerdict, asyncpg.Record]]:
        """Could any node of the fleet ever run this spec? Hard compatibility only (pool, arch,
        backend, protocol, labels, capabilities, too large): every node that is not removed is
        judged as if it were online, undrained and empty, since connections, health, drains and
        what is free now all change. Reads only; stores nothing."""
        rows = {r["id"]: r for r in await self.store.list_nodes() if r["revoked_at"] is None}
        req = requirements(spec, cpu, memory, disk, gpus)
        empty = Resources(0, 0, 0, 0, 0)
        snaps = [
            dataclasses.replace(
                node_snapshot({**dict(r), "gpus_in_use": []}), connected=True, health="online", draining=False, reserved=empty
            )
            for r in rows.values()
        ]
        return [(v, rows[v.node_id]) for v in explain(req, snaps, policy=self.policy_name)]

    async def node_removed(self, node_id: str) -> None:
        """A node was removed from the fleet: its tasks go through the node-loss policy now, not
        after OfflineAfter — it will never report again."""
        for r in await self.store.tasks_on_node(node_id):
            row = await self.store.get_task(r["id"])
            f = facts(row)
            await self.apply(r["id"], f.state, policy.on_node_loss(f, reasons.NODE_REVOKED), fencing_token=r["fencing_token"])

    async def cancel(self, task_id: uuid.UUID, actor: str, if_revision: int | None = None) -> asyncpg.Record:
        """Cancel a task: a queued one ends at once; one on a node is told to stop. Retries the
        compare-and-set when the task moved underneath (e.g. it was placed in between). With
        `if_revision`, only while the task is still at that assignment revision (checked in the
        compare-and-set itself): otherwise PreconditionFailed, naming both revisions."""
        for _ in range(10):
            row = await self.store.get_task(task_id)
            if if_revision is not None and row["revision"] != if_revision:
                raise PreconditionFailed(
                    f"task {task_id} is at revision {row['revision']}, not revision {if_revision} as this request "
                    f"expects (it is {row['state']} now); read it again (`podium show {task_id}`) and decide again"
                )
            f = facts(row)
            step = policy.on_cancel(f)
            if step is None:
                return row  # already ended or already being cancelled: nothing to do
            if await self.apply(task_id, f.state, step, actor=actor, fencing_token=row["fencing_token"], revision=if_revision):
                return await self.store.get_task(task_id)
        raise NotFound(f"task {task_id} kept changing state; try again")
