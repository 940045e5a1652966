-- Every statement that reads or writes tasks, attempts, events and logs, as named blocks.
-- `podium.store.db.Store` is the only code that runs them.

-- insert_tasks --
-- Submissions (one, or a batch) in one statement: each task, its first event and its audit entry,
-- and one NOTIFY. ON CONFLICT on the idempotency key makes a retried submit return no row for it;
-- the caller then reads the task the first submit created.
WITH d AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::int[], $5::bigint[], $6::bigint[], $7::bigint[],
                         $8::int[], $9::float8[], $10::int[], $11::bool[], $12::text[], $15::text[], $16::int[])
        AS d(id, name, spec, priority, cpu, mem, disk, gpus, timeout, max_attempts, requeue, ikey, spec_name, spec_revision)
), t AS (
    INSERT INTO tasks (id, name, spec, state, reason, priority, cpu_millis, memory_bytes, disk_bytes, gpus,
                       timeout_seconds, max_attempts, requeue_on_node_loss, idempotency_key, submitted_by,
                       spec_name, spec_revision)
    SELECT id, name, spec, 'queued', $13, priority, cpu, mem, disk, gpus, timeout, max_attempts, requeue, ikey, $14,
           spec_name, spec_revision
    FROM d
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING *
), e AS (
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor)
    SELECT id, NULL, 'queued', NULL, $14 FROM t
), a AS (
    INSERT INTO audit_log (actor, action, target, detail)
    SELECT $14, 'task.submit', id::text, jsonb_build_object('name', name) FROM t
), n AS (
    SELECT pg_notify('podium_dispatch', '') FROM t LIMIT 1
)
SELECT t.*, (SELECT count(*) FROM n) AS notified FROM t

-- tasks_by_idempotency_keys --
SELECT * FROM tasks WHERE idempotency_key = ANY($1::text[])

-- task_by_idempotency_key --
SELECT * FROM tasks WHERE idempotency_key = $1

-- transition_task --
-- The one compare-and-set every state change goes through. $2 is the expected state; $5 (a fencing
-- token) and $6 (a node id) are checked when a node is the actor. Zero rows: rejected, nothing changed.
-- $9 ends the current attempt with that attempt state, freeing its capacity exactly once; $10 moves
-- it forward instead (provisioning, running); $11 asks the node to stop it.
WITH t AS (
    UPDATE tasks SET
        state = $3,
        reason = $4,
        exit_code = CASE WHEN $7::int IS NULL THEN exit_code ELSE $7 END,
        lease_expires_at = CASE
            WHEN $9::text IS NOT NULL THEN NULL
            WHEN $8::float8 IS NULL THEN lease_expires_at
            WHEN $8 < 0 THEN NULL
            ELSE now() + make_interval(secs => $8) END,
        accept_deadline = CASE WHEN $3 = 'assigned' THEN accept_deadline ELSE NULL END,
        started_at = CASE
            WHEN $9::text IS NOT NULL THEN NULL
            WHEN $3 = 'running' AND started_at IS NULL THEN now()
            ELSE started_at END,
        cancel_requested_at = CASE WHEN $3 = 'cancelling' THEN now() WHEN $3 = 'queued' THEN NULL ELSE cancel_requested_at END,
        cancel_reason = CASE WHEN $3 = 'cancelling' THEN $4 WHEN $3 = 'queued' THEN NULL ELSE cancel_reason END,
        node_id = CASE WHEN $9::text IS NOT NULL THEN NULL ELSE node_id END,
        finished_at = CASE WHEN $3 IN ('succeeded', 'failed', 'cancelled', 'lost') THEN now() ELSE NULL END,
        updated_at = now()
    WHERE id = $1 AND state = $2
      AND ($5::bigint IS NULL OR fencing_token = $5)
      AND ($6::text IS NULL OR node_id = $6)
    RETURNING id, fencing_token, state
), ended AS (
    UPDATE attempts a SET
        state = $9, finished_at = now(), reason = $4, released = true,
        exit_code = CASE WHEN $7::int IS NULL THEN a.exit_code ELSE $7 END,
        stop_requested_at = CASE WHEN $11::bool THEN now() ELSE a.stop_requested_at END
    FROM t
    WHERE $9::text IS NOT NULL AND a.fencing_token = t.fencing_token AND NOT a.released
    RETURNING a.node_id, a.cpu_millis, a.memory_bytes, a.disk_bytes, a.gpus, a.fencing_token
), unclaimed AS (
    DELETE FROM gpu_claims g USING ended WHERE g.fencing_token = ended.fencing_token AND ended.gpus > 0
), moved AS (
    UPDATE attempts a SET
        state = COALESCE($10::text, a.state),
        provisioning_at = CASE WHEN $10 = 'provisioning' THEN now() ELSE a.provisioning_at END,
        started_at = CASE WHEN $10 = 'running' THEN now() ELSE a.started_at END,
        stop_requested_at = CASE WHEN $11::bool THEN now() ELSE a.stop_requested_at END,
        stop_sent_at = CASE WHEN $11::bool THEN NULL ELSE a.stop_sent_at END
    FROM t
    WHERE $9::text IS NULL AND ($10::text IS NOT NULL OR $11::bool) AND a.fencing_token = t.fencing_token
    RETURNING a.node_id
), freed AS (
    UPDATE nodes n SET
        res_cpu_millis = n.res_cpu_millis - ended.cpu_millis,
        res_memory_bytes = n.res_memory_bytes - ended.memory_bytes,
        res_disk_bytes = n.res_disk_bytes - ended.disk_bytes,
        res_gpus = n.res_gpus - ended.gpus,
        res_slots = n.res_slots - 1
    FROM ended WHERE n.id = ended.node_id
    RETURNING n.id
), e AS (
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor, fencing_token)
    SELECT t.id, $2, $3, $4, $12, t.fencing_token FROM t
)
SELECT t.id, t.fencing_token,
       (SELECT node_id FROM ended UNION ALL SELECT node_id FROM moved LIMIT 1) AS attempt_node,
       (SELECT count(*) FROM freed) AS freed,
       -- wake the node's gateway when it must send a stop, and the dispatcher when room was freed
       -- or work was queued; delivered only if this statement commits
       (SELECT count(*) FROM (SELECT pg_notify('podium_node', x.node_id)
            FROM (SELECT node_id FROM ended UNION ALL SELECT node_id FROM moved) x WHERE $11::bool) n1) AS woke_node,
       (SELECT count(*) FROM (SELECT pg_notify('podium_dispatch', '')
            FROM (SELECT 1 FROM freed UNION ALL SELECT 1 WHERE $3 = 'queued') y) n2) AS woke_dispatch
FROM t

-- claim_queued --
-- The dispatch claim. SKIP LOCKED lets several schedulers claim disjoint batches at once. `avoid` is
-- the nodes earlier attempts were lost on, revoked from or failed on: placement tries others first.
SELECT t.id, t.spec, t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, t.reason,
       ARRAY(SELECT DISTINCT a.node_id FROM attempts a
             WHERE a.task_id = t.id AND a.state IN ('revoked', 'lost', 'failed')) AS avoid
FROM tasks t
WHERE t.state = 'queued'
ORDER BY t.priority DESC, t.created_at, t.id
LIMIT $1
FOR UPDATE OF t SKIP LOCKED

-- reserve_capacity --
-- Take capacity on each node for a batch of placements; a node that no longer has room (another
-- scheduler got there first) is simply not returned, and its tasks stay queued for the next tick.
UPDATE nodes n SET
    res_cpu_millis = n.res_cpu_millis + d.cpu,
    res_memory_bytes = n.res_memory_bytes + d.mem,
    res_disk_bytes = n.res_disk_bytes + d.disk,
    res_gpus = n.res_gpus + d.gpus,
    res_slots = n.res_slots + d.slots
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::int[], $6::int[])
     AS d(id, cpu, mem, disk, gpus, slots)
WHERE n.id = d.id
  AND n.connected AND n.health = 'online' AND NOT n.draining AND n.revoked_at IS NULL
  AND n.res_cpu_millis + d.cpu <= n.alloc_cpu_millis
  AND n.res_memory_bytes + d.mem <= n.alloc_memory_bytes
  AND n.res_disk_bytes + d.disk <= n.alloc_disk_bytes
  AND n.res_gpus + d.gpus <= n.alloc_gpus
  AND n.res_slots + d.slots <= n.alloc_slots
RETURNING n.id

-- assign_tasks --
-- The batched form of transition_task(queued → assigned): one attempt, one new fencing token, a lease
-- and an accept deadline per task, and an event, all in one statement.
WITH d AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[]) AS d(id, node_id, gpu_indexes)
), t AS (
    UPDATE tasks SET
        state = 'assigned', reason = NULL, node_id = d.node_id,
        fencing_token = nextval('fencing_tokens'), attempts = tasks.attempts + 1,
        -- clock_timestamp(), not now(): a transaction that was slow between its claim and this write
        -- must not hand out an assignment with its accept window already spent
        accept_deadline = clock_timestamp() + make_interval(secs => $4),
        lease_expires_at = clock_timestamp() + make_interval(secs => $5),
        exit_code = NULL, started_at = NULL, cancel_requested_at = NULL, cancel_reason = NULL,
        updated_at = now()
    FROM d
    WHERE tasks.id = d.id AND tasks.state = 'queued'
    RETURNING tasks.id, tasks.node_id, tasks.fencing_token, tasks.attempts, tasks.cpu_millis,
              tasks.memory_bytes, tasks.disk_bytes, tasks.gpus, tasks.accept_deadline, d.gpu_indexes
), a AS (
    INSERT INTO attempts (task_id, attempt, fencing_token, node_id, state, cpu_millis, memory_bytes,
                          disk_bytes, gpus, gpu_indexes, accept_deadline)
    SELECT id, attempts, fencing_token, node_id, 'assigned', cpu_millis, memory_bytes, disk_bytes, gpus,
           COALESCE(string_to_array(NULLIF(gpu_indexes, ''), ',')::int[], '{}'), accept_deadline
    FROM t
), g AS (
    -- the primary key makes a GPU index impossible to hand out twice: a racing scheduler's whole
    -- batch fails and is retried on fresh state
    INSERT INTO gpu_claims (node_id, gpu_index, fencing_token)
    SELECT t.node_id, gi::int, t.fencing_token FROM t, unnest(string_to_array(NULLIF(t.gpu_indexes, ''), ',')) gi
), e AS (
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor, fencing_token)
    SELECT id, 'queued', 'assigned', NULL, $6, fencing_token FROM t
)
SELECT t.id, t.node_id, t.fencing_token FROM t

-- set_queued_reasons --
UPDATE tasks SET reason = d.reason, updated_at = now()
FROM unnest($1::uuid[], $2::text[]) AS d(id, reason)
WHERE tasks.id = d.id AND tasks.state = 'queued' AND tasks.reason IS DISTINCT FROM d.reason

-- notify_nodes --
SELECT pg_notify('podium_node', n) FROM unnest($1::text[]) AS n

-- notify_dispatch --
SELECT pg_notify('podium_dispatch', '')

-- take_outbox --
-- What a gateway owes one node: Assigns not yet pushed, and stops not yet sent. Marked as sent in the
-- same statement; a send that then fails is repaired by the node's next Hello.
WITH assigns AS (
    UPDATE attempts a SET delivered_at = now()
    FROM tasks t
    WHERE a.node_id = $1 AND a.state = 'assigned' AND a.delivered_at IS NULL
      AND t.id = a.task_id AND t.fencing_token = a.fencing_token AND t.state = 'assigned'
    RETURNING a.task_id, a.attempt, a.fencing_token, a.gpu_indexes, t.spec::text AS spec
), stops AS (
    UPDATE attempts a SET stop_sent_at = now()
    WHERE a.node_id = $1 AND a.stop_requested_at IS NOT NULL AND a.stop_sent_at IS NULL
    RETURNING a.task_id, a.fencing_token, a.reason
)
SELECT 'assign' AS kind, task_id, attempt, fencing_token, gpu_indexes, spec, NULL AS reason FROM assigns
UNION ALL
SELECT 'stop', task_id, NULL, fencing_token, NULL, NULL, reason FROM stops

-- tasks_on_node --
SELECT id, state, fencing_token FROM tasks
WHERE node_id = $1 AND state IN ('assigned', 'provisioning', 'running', 'cancelling')

-- redeliver --
UPDATE attempts SET delivered_at = NULL WHERE fencing_token = ANY($1::bigint[]) AND state = 'assigned'

-- request_stop --
-- Tell a node to stop an attempt it should not be running (a stale token it reported).
UPDATE attempts SET stop_requested_at = now(), stop_sent_at = NULL
WHERE fencing_token = ANY($1::bigint[]) AND node_id = $2

-- get_task --
SELECT * FROM tasks WHERE id = $1

-- task_attempts --
SELECT * FROM attempts WHERE task_id = $1 ORDER BY attempt

-- task_events --
SELECT * FROM task_events WHERE task_id = $1 ORDER BY id

-- list_tasks --
SELECT * FROM tasks
WHERE ($1::text IS NULL OR state = $1)
  AND ($2::text IS NULL OR node_id = $2)
  AND ($3::text IS NULL OR name = $3)
ORDER BY created_at DESC, id DESC
LIMIT $4

-- insert_logs --
-- Log chunks from a node, kept only for attempts that node was given.
INSERT INTO log_chunks (task_id, fencing_token, stream, seq, data)
SELECT d.task_id, d.token, d.stream, d.seq, d.data
FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::bigint[], $5::bytea[]) AS d(task_id, token, stream, seq, data)
JOIN attempts a ON a.task_id = d.task_id AND a.fencing_token = d.token AND a.node_id = $6
ON CONFLICT DO NOTHING

-- read_logs --
SELECT l.id, l.fencing_token, a.attempt, l.stream, l.data, l.at
FROM log_chunks l JOIN attempts a ON a.fencing_token = l.fencing_token
WHERE l.task_id = $1 AND l.id > $2
ORDER BY l.id
LIMIT $3

-- watch_overdue_accept --
SELECT id, state, fencing_token, attempts, max_attempts FROM tasks
WHERE state = 'assigned' AND accept_deadline < now()
LIMIT $1

-- watch_timeouts --
SELECT id, state, fencing_token FROM tasks
WHERE state = 'running' AND timeout_seconds IS NOT NULL
  AND started_at + make_interval(secs => timeout_seconds) < now()
LIMIT $1

-- watch_cancel_grace --
SELECT id, state, fencing_token, cancel_reason FROM tasks
WHERE state = 'cancelling' AND cancel_requested_at < now() - make_interval(secs => $1)
LIMIT $2

-- watch_lost --
-- Tasks whose node is offline, whose lease has run out, or that claim to be on a node with no lease
-- of any kind.
SELECT t.id, t.state, t.fencing_token, t.attempts, t.max_attempts, t.requeue_on_node_loss,
       CASE WHEN t.node_id IS NULL OR t.fencing_token IS NULL THEN 'no_lease'
            WHEN n.health = 'offline' THEN 'offline'
            ELSE 'lease' END AS why
FROM tasks t LEFT JOIN nodes n ON n.id = t.node_id
WHERE t.state IN ('assigned', 'provisioning', 'running')
  AND (t.node_id IS NULL OR t.fencing_token IS NULL OR n.health = 'offline' OR t.lease_expires_at < now())
LIMIT $1

-- prune_finished --
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE finished_at < now() - make_interval(secs => $1) LIMIT $2)

-- latest_named_spec --
SELECT * FROM named_specs WHERE name = $1 ORDER BY revision DESC LIMIT 1

-- named_spec_revision --
SELECT * FROM named_specs WHERE name = $1 AND revision = $2

-- put_named_spec --
-- A new revision; the primary key refuses a concurrent writer that read the same latest revision.
INSERT INTO named_specs (name, revision, spec, created_by)
VALUES ($1, COALESCE((SELECT max(revision) FROM named_specs WHERE name = $1), 0) + 1, $2, $3)
RETURNING *

-- list_named_specs --
SELECT DISTINCT ON (name) * FROM named_specs ORDER BY name, revision DESC
