"""The watchdog loop: every `Timing.watchdog`, applies the deadlines to every task a node owes an
answer for — the accept deadline, the spec's timeout, the operator's cancel, the lease, a drain's
deadline, a superseded instance's fence deadline — turns node silence into `unreachable`, then
`offline` and the node-loss policy, and prunes what ended longer ago than the retention.

Every time is the database's `now()`; every change is the policy's Step applied as a compare-and-set
from the state just read, so a late node event or another server's sweep racing this one makes it a
no-op, never a second transition.
"""

from __future__ import annotations

import asyncio
import logging

from podium import reasons
from podium.errors import StoreUnavailable
from podium.scheduler import policy
from podium.scheduler.apply import Applier, facts
from podium.store import Store
from podium.store.rows import TaskFactsRow
from podium.timing import Timing

log = logging.getLogger(__name__)

SWEEP_LIMIT = 1000  # rows one watchdog query looks at; the next sweep takes the rest
PRUNE_EVERY = 60.0  # seconds between deletions of tasks older than the retention
PRUNE_BATCH = 5000  # tasks deleted at most per pass, so one pass never holds locks for long
DEFAULT_RETENTION = 7 * 86400.0  # seconds a finished task, its events and its logs are kept


class Watchdog:
    def __init__(self, store: Store, timing: Timing, applier: Applier, *, retention: float = DEFAULT_RETENTION) -> None:
        self.store = store
        self.timing = timing
        self.applier = applier
        self.retention = retention
        self._last_prune = 0.0

    async def loop(self) -> None:
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
            await asyncio.sleep(self.timing.watchdog)

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
            f = facts(row)
            await self.applier.apply(row.id, f.state, policy.on_lost(f, row.why), fencing_token=row.fencing_token)

        # Attempts a node's new agent instance did not report, once the instance it superseded has
        # certainly stopped them (its fence deadline passed): only now may they run elsewhere.
        for row in await self.store.handover_due(SWEEP_LIMIT):
            await self._node_loss(row, reasons.INSTANCE_REPLACED, "handover")
        await self.store.handover_done()

        # Container attempts that ended on a node the node-loss policy has now given up on will never
        # get their release proof: release them, with a proof that says so.
        for r in await self.store.release_abandoned(SWEEP_LIMIT):
            log.info("attempt %d of task %s on node %s: released without a proof (its node is gone)",
                     r.fencing_token, r.task_id, r.node_id)  # fmt: skip

        # A drain's deadline passed: what still runs on the node goes through the node-loss policy
        # (requeued if the spec allows it and attempts remain, else lost; docs/decisions.md), each a
        # compare-and-set from the state and attempt just read.
        for row in await self.store.drain_overdue(SWEEP_LIMIT):
            await self._node_loss(row, reasons.DRAIN_DEADLINE, "drain")

        for row in await self.store.overdue_accepts(SWEEP_LIMIT):
            f = facts(row)
            await self.applier.apply(row.id, f.state, policy.on_accept_overdue(f), fencing_token=row.fencing_token)

        for row in await self.store.timed_out(SWEEP_LIMIT):
            f = facts(row)
            await self.applier.apply(row.id, f.state, policy.on_cancel(f, reasons.TIMEOUT), fencing_token=row.fencing_token)

        for row in await self.store.cancel_grace_expired(t.cancel_grace, SWEEP_LIMIT):
            f = facts(row)
            await self.applier.apply(row.id, f.state, policy.on_cancel_grace(f), fencing_token=row.fencing_token)

    async def _node_loss(self, row: TaskFactsRow, reason: str, kind: str) -> None:
        """The node-loss policy for a task still on its node, and, if it took, a node event of `kind`
        saying which attempt went and why."""
        f = facts(row)
        done = await self.applier.apply(row.id, f.state, policy.on_node_loss(f, reason), fencing_token=row.fencing_token)
        if done is not None and row.node_id is not None:
            await self.store.node_event(
                row.node_id, kind, f"task {row.id} (attempt token {row.fencing_token}): {reason}",
                {"task": str(row.id), "fencing_token": row.fencing_token},
            )
