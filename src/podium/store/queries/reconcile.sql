-- The reconcile loop's statements (scheduler/reconcile.py), and what a node's Hello adds for it.

-- claim_reconcile --
-- Claim up to $2 live attempts due for a check, for owner $1, until $3 seconds from now. A claim
-- still live (another replica holds it) is skipped; one whose owner let it expire is taken over.
-- SKIP LOCKED: replicas claim disjoint batches without waiting for each other or for a transition.
-- The UPDATE is the compare-and-set: from "unclaimed or expired" to "claimed by $1".
WITH due AS (
    SELECT a.fencing_token FROM attempts a
    WHERE a.finished_at IS NULL AND a.next_reconcile_at <= now()
      AND (a.reconcile_claim_expires_at IS NULL OR a.reconcile_claim_expires_at <= now())
    ORDER BY a.next_reconcile_at, a.fencing_token
    LIMIT $2
    FOR NO KEY UPDATE OF a SKIP LOCKED
), c AS (
    UPDATE attempts a SET reconcile_owner = $1, reconcile_claim_expires_at = now() + make_interval(secs => $3)
    FROM due
    WHERE a.fencing_token = due.fencing_token AND a.finished_at IS NULL
      AND (a.reconcile_claim_expires_at IS NULL OR a.reconcile_claim_expires_at <= now())
    RETURNING a.task_id, a.fencing_token, a.node_id, a.state AS attempt_state, a.provisioning_at,
              a.backend_kind, a.capability_snapshot, a.reconcile_claim_expires_at
)
SELECT c.*, t.state, t.fencing_token AS task_token, t.attempts, t.max_attempts, t.requeue_on_node_loss,
       t.timeout_seconds, t.cancel_reason,
       n.health, n.connected, n.revoked_at IS NOT NULL AS node_removed, n.materializations,
       -- an attempt of a superseded instance stays the handover's until the watchdog has dealt with it
       -- (its reason says the agent was replaced), even a moment after the deadline
       COALESCE(n.handover_until > now(), false) OR c.fencing_token = ANY(n.handover_tokens) AS in_handover,
       COALESCE(c.provisioning_at < n.connected_at, false) AS before_hello,
       c.fencing_token = ANY(n.hello_tokens) AS in_hello
FROM c JOIN tasks t ON t.id = c.task_id JOIN nodes n ON n.id = c.node_id
ORDER BY c.fencing_token

-- finish_reconcile --
-- Record each check's result and release its claim: only claims still held by $2 (one that expired
-- and was taken over by another replica is that replica's now, and this answer is dropped).
UPDATE attempts a SET
    reconcile_owner = NULL, reconcile_claim_expires_at = NULL,
    last_reconciled_at = now(), last_reconciled_by = $2, last_reconcile_result = d.result,
    next_reconcile_at = now() + make_interval(secs => d.next_in)
FROM unnest($1::bigint[], $3::text[], $4::float8[]) AS d(token, result, next_in)
WHERE a.fencing_token = d.token AND a.reconcile_owner = $2
RETURNING a.fencing_token

-- hello_facts --
-- What a node's Hello says beyond node_hello's facts, in the same transaction: the attempts it still
-- holds, its limit on provisioning operations, its materialization snapshots. Returns the snapshots
-- it had before, so a changed runtime can be told.
UPDATE nodes n SET hello_tokens = $2, max_operations = $3, materializations = $4
FROM (SELECT materializations FROM nodes WHERE id = $1) old
WHERE n.id = $1
RETURNING old.materializations AS before

-- operations_in_flight --
SELECT node_id, n FROM {{operations: attempts}}

-- _operations --
-- A fragment: `{{operations: attempts}}` is the capacity operations per node (node_id, n), the
-- attempts that hold one now (assigned or provisioning, not ended).
(SELECT node_id, count(*)::int AS n FROM __ROWS__
 WHERE finished_at IS NULL AND state IN ('assigned', 'provisioning')
 GROUP BY node_id) operations

-- runtime_changed --
-- A node's runtime changed for some backends ($2): its live attempts on them are due for a check
-- now (the reconcile loop), and a node event says so, naming the attempts.
WITH due AS (
    UPDATE attempts SET next_reconcile_at = now()
    WHERE node_id = $1 AND finished_at IS NULL AND backend_kind = ANY($2::text[])
    RETURNING fencing_token
)
INSERT INTO node_events (node_id, kind, message, detail)
VALUES ($1, 'runtime_changed', $3,
        $4::jsonb || jsonb_build_object('rechecked', (SELECT COALESCE(jsonb_agg(fencing_token ORDER BY fencing_token), '[]'::jsonb) FROM due)))
RETURNING id
