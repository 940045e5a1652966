"""The store's row types against the queries that fill them (issue 12: the store returns its own
row types). Each query is prepared on a migrated database and its columns compared with its row:
every field the row requires is selected, and a column the row leaves out is one named here, so a
column added to a query but not to its row (silently dropped by `Row.of`) fails this test."""

from __future__ import annotations

import dataclasses

import pytest

from podium.store import Store
from podium.store import rows as R

# query → (its row type, the columns it returns that the row leaves out, and why)
# never shown: the credential's hash, the change horizon, the agent instance that may enrol it again
NODE_INTERNALS = {"credential_hash", "changed_xid", "facts_xid", "enrolled_by_instance"}
QUERIES: dict[str, tuple[type[R.Row], set[str]]] = {
    "insert_tasks": (R.TaskRow, {"notified"}),  # how many NOTIFYs the insert sent
    "tasks_by_idempotency_keys": (R.TaskRow, set()),
    "get_task": (R.TaskRow, set()),
    "list_tasks": (R.TaskRow, set()),
    "list_tasks_in_state": (R.TaskRow, set()),
    "task_attempts": (R.AttemptRow, set()),
    "task_events": (R.TaskEventRow, set()),
    "task_events_page": (R.TaskEventRow, set()),
    "read_logs": (R.LogChunkRow, set()),
    # the marker of a short claim that passed over a held task, and the claim order's keys
    "claim_queued": (R.ClaimedTaskRow, {"held", "priority", "created_at", "locked"}),
    # and the submission stored by the same statement: each of its tasks a row of its own (`stored`)
    "insert_tasks_claiming": (R.ClaimedTaskRow, {"held", "priority", "created_at", "locked", "stored", "notified"}),
    "claim_unresolved": (R.UnresolvedRow, set()),
    "tasks_on_node": (R.NodeTaskRow, set()),
    "lock_task_facts": (R.TaskFactsRow, set()),
    "lock_task_facts_storing_logs": (R.TaskFactsRow, set()),
    "handover_due": (R.TaskFactsRow, set()),
    "drain_overdue": (R.TaskFactsRow, set()),
    "watch_overdue_accept": (R.TaskFactsRow, set()),
    "watch_timeouts": (R.TaskFactsRow, set()),
    "watch_cancel_grace": (R.TaskFactsRow, set()),
    "watch_lost": (R.TaskFactsRow, set()),
    "take_outbox": (R.OutboxRow, set()),
    "claim_reconcile": (R.ReconcileClaimRow, set()),
    "release_abandoned": (R.AbandonedReleaseRow, {"nodes"}),  # how many nodes had capacity freed
    "placement_nodes": (R.NodeRow, NODE_INTERNALS),
    # a dispatch pass's facts (the horizon, the window, the operations), repeated beside each changed
    # node, and what NodeRoomRow reads of it (each row is one or the other, see Store.dispatch)
    "dispatch_facts": (R.NodeRow, NODE_INTERNALS | {"horizon", "in_flight", "operation_nodes", "operations", "tokens",
                                                    "room_node", "room_cpu_millis", "room_memory_bytes",
                                                    "room_disk_bytes", "room_gpus", "room_slots"}),
    "list_nodes": (R.NodeRow, NODE_INTERNALS),
    "list_nodes_page": (R.NodeRow, NODE_INTERNALS),
    "get_node": (R.NodeRow, NODE_INTERNALS),
    "nodes_by_prefix": (R.NodeRow, NODE_INTERNALS),
    "node_hello": (R.NodeSessionRow, {"pg_notify"}),
    "node_events": (R.NodeEventRow, set()),
    "nodes_releasing": (R.ReleasingRow, set()),
    "node_credential": (R.NodeCredentialRow, set()),
    "put_named_spec": (R.NamedSpecRow, set()),
    "latest_named_spec": (R.NamedSpecRow, set()),
    "named_spec_revision": (R.NamedSpecRow, set()),
    "list_named_specs": (R.NamedSpecRow, set()),
    "ui_spec_revisions": (R.NamedSpecRow, set()),
    "insert_token": (R.TokenRow, set()),
    "list_tokens": (R.TokenRow, set()),
    "revoke_token": (R.TokenRow, set()),
    "get_token": (R.TokenCheckRow, set()),
    "put_secret": (R.SecretRow, set()),
    "list_secrets": (R.SecretRow, set()),
    "get_secrets": (R.SealedSecretRow, set()),
    "read_audit": (R.AuditRow, set()),
    "events_after": (R.StreamEventRow, set()),
    "ui_tasks_page": (R.TaskSummaryRow, set()),
    "ui_session_get": (R.UiSessionRow, set()),
}


async def test_each_row_type_matches_the_columns_of_its_queries(store: Store) -> None:
    problems = []
    async with store.pool.acquire() as conn:
        for name, (row, left_out) in QUERIES.items():
            fields = dataclasses.fields(row)
            required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
            columns = {a.name for a in (await conn.prepare(store.q[name])).get_attributes()}
            if missing := required - columns:
                problems.append(f"{name} does not select {sorted(missing)}, which {row.__name__} requires")
            if dropped := columns - {f.name for f in fields} - left_out:
                problems.append(f"{name} selects {sorted(dropped)}, which {row.__name__} has no field for")
    assert problems == []


def test_a_record_missing_a_required_column_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="state"):
        R.NodeTaskRow.of({"id": "x", "fencing_token": 1})
    # a column the row has no field for is left out; one with a default may be missing
    facts = R.TaskFactsRow.of({"id": "x", "state": "queued", "pg_notify": None})
    assert (facts.state, facts.attempts) == ("queued", 1)
