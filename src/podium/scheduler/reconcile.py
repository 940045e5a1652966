"""The reconcile loop: every live attempt is checked, again and again, against what its node last
said — its last Hello (the attempts it still held), its health and connection, its runtime — also
when the node never reconnects.

A replica claims due attempts (`FOR UPDATE SKIP LOCKED`, a claim naming it that expires after
`Timing.reconcile_claim`), lets the pure policy (`policy.on_reconcile`) decide each, applies any
transition as a compare-and-set from the state it read, records the result sentence and releases
the claim. A replica that dies holding claims loses them at the expiry; another takes them over.
Nothing here is decided from memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from podium import reasons
from podium.errors import StoreUnavailable
from podium.scheduler import policy
from podium.scheduler.apply import Applier, facts
from podium.states import TaskState
from podium.store import Store
from podium.store.reconcile import ReconcileStore
from podium.store.rows import ReconcileClaimRow
from podium.timing import Timing

log = logging.getLogger(__name__)

BATCH = 500  # attempts one claim takes at most; a full batch is followed by the next at once

# Test knobs, read once when the loop is made. HOLD: seconds the loop waits, holding its claims,
# between claiming and checking (a replica stalled or killed mid-claim). CLAIM: the claim's length in
# seconds instead of Timing.reconcile_claim (so a test can outlast a replica's start-up).
HOLD_ENV = "PODIUM_TEST_RECONCILE_HOLD"
CLAIM_ENV = "PODIUM_TEST_RECONCILE_CLAIM"


def runtime_changed(row: ReconcileClaimRow) -> bool:
    """Whether the node's runtime digest for the attempt's backend differs from the one recorded in
    its capability snapshot at assignment (an attempt assigned before snapshots existed, or to a
    node that reports none, has nothing to compare)."""
    kind = row.backend_kind
    then = [m for m in (row.capability_snapshot or {}).get("materializations") or () if m.get("backend_kind") == kind]
    now = [m for m in row.materializations or () if m.get("backend_kind") == kind]
    return bool(policy.runtime_changes(then, now))


def reconcile_facts(row: ReconcileClaimRow) -> policy.ReconcileFacts:
    return policy.ReconcileFacts(
        task=facts(row),
        current=row.task_token == row.fencing_token,
        attempt_state=row.attempt_state,
        node_removed=row.node_removed,
        node_health=row.health,
        node_connected=row.connected,
        in_handover=row.in_handover,
        before_hello=row.before_hello,
        in_hello=row.in_hello,
        runtime_changed=runtime_changed(row),
    )


class Reconciler:
    def __init__(self, store: Store, applier: Applier, timing: Timing, *, server_id: str) -> None:
        self.store = ReconcileStore(store)
        self.applier = applier
        self.timing = timing
        self.owner = server_id
        self.actor = f"reconcile:{server_id}"
        self.hold = float(os.environ.get(HOLD_ENV, "0") or 0)
        self.claim_seconds = float(os.environ.get(CLAIM_ENV, "0") or 0) or timing.reconcile_claim
        self.checked_total = 0

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {"scheduler.reconcile": self.loop}

    async def loop(self) -> None:
        while True:
            try:
                if await self.once() >= BATCH:
                    continue
            except StoreUnavailable as e:
                log.warning("reconcile: %s; retrying", e)
            await asyncio.sleep(self.timing.watchdog)

    async def once(self) -> int:
        """One claim, its checks and their results; how many attempts were claimed."""
        rows = await self.store.claim(self.owner, BATCH, self.claim_seconds)
        if not rows:
            return 0
        if self.hold:
            log.warning("reconcile: holding %d claims for %.0fs (%s)", len(rows), self.hold, HOLD_ENV)
            await asyncio.sleep(self.hold)
        results: list[tuple[int, str, float]] = []
        for row in rows:
            verdict = policy.on_reconcile(reconcile_facts(row), self.timing)
            if verdict.step is not None:
                done = await self.applier.apply(
                    row.task_id, TaskState(row.state), verdict.step, actor=self.actor, fencing_token=row.fencing_token
                )
                if done is None:
                    # the task moved since the claim read it: decide again on what it is now, soon
                    results.append((row.fencing_token, reasons.RECONCILED_MOVED, 0.0))
                    continue
                log.info("task %s (attempt token %d): %s", row.task_id, row.fencing_token, verdict.result)
            results.append((row.fencing_token, verdict.result, verdict.next_in))
        recorded = await self.store.finish(self.owner, results)
        if len(recorded) < len(results):
            log.info("reconcile: %d claims had expired and were taken over by another replica", len(results) - len(recorded))
        self.checked_total += len(recorded)
        return len(rows)
