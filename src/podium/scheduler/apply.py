"""The one applier: what the policy decided (a `Step`) becomes one compare-and-set in the store.

Everything that acts on a policy decision — the dispatcher's and the watchdog's loops, the gateway's
report batches and its deliveries, the operator's cancel — reads a task, asks `policy` for a Step,
and hands it here (or, for a group commit, turns it into a `Change` with `change` and gives the batch
to `Store.transition_many`). This module decides nothing and never transitions from memory: the
`from` is always the state the caller just read.
"""

from __future__ import annotations

import logging
import uuid

from podium.scheduler.policy import Step, TaskFacts
from podium.states import TaskState
from podium.store import AuditEntry, Change, Store, Transition
from podium.store.rows import ReconcileClaimRow, TaskFactsRow, TaskRow

log = logging.getLogger(__name__)


def facts(row: TaskFactsRow | TaskRow | ReconcileClaimRow) -> TaskFacts:
    """What the policy needs to know about a task, from any of the store's rows that carry it (a
    `TaskFactsRow` from a query that selects less keeps its defaults)."""
    return TaskFacts(
        state=TaskState(row.state),
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        requeue_on_node_loss=row.requeue_on_node_loss,
        timeout=row.timeout_seconds,
        cancel_reason=row.cancel_reason,
    )


def change(
    task_id: uuid.UUID,
    from_: TaskState,
    step: Step,
    *,
    actor: str,
    fencing_token: int | None = None,
    node_id: str | None = None,
    revision: int | None = None,
    backend_ref: str | None = None,
) -> Change:
    """The store change a Step means, from the state just read: the only place a Step is translated."""
    return Change(
        task_id, from_, step.to, actor=actor, reason=step.reason, fencing_token=fencing_token, node_id=node_id,
        exit_code=step.exit_code, lease_seconds=step.lease_seconds, end_attempt=step.end_attempt,
        attempt_state=step.attempt_state, stop=step.stop, failure_class=step.failure_class, detail=step.detail,
        backend_ref=backend_ref or None, release=step.release, revision=revision,
    )  # fmt: skip


class Applier:
    """Applies Steps through one store, as one actor unless told otherwise."""

    def __init__(self, store: Store, *, actor: str) -> None:
        self.store = store
        self.actor = actor

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
        audit: AuditEntry | None = None,
    ) -> Transition | None:
        """One compare-and-set from `from_`; None when the step is None or the task moved meanwhile.
        `audit` is recorded with the change, in its transaction, by the same actor."""
        if step is None:
            return None
        c = change(
            task_id, from_, step, actor=actor or self.actor, fencing_token=fencing_token, node_id=node_id, revision=revision
        )
        result = await self.store.transition(c, audit=audit)
        if result is not None:
            log.debug("task %s: %s → %s (%s)", task_id, from_, step.to, step.reason or "-")
        return result
