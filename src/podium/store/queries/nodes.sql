-- node_hello --
-- A node (re)connects: record its facts and capacity, take its session for this gateway.
INSERT INTO nodes (id, name, pool, arch, labels, capabilities, backends, artifacts, protocol_min,
                   protocol_max, gpu_indexes, alloc_cpu_millis, alloc_memory_bytes, alloc_disk_bytes,
                   alloc_gpus, alloc_slots, health, connected, gateway_id, session, last_heartbeat_at,
                   connected_at, agent_version, instance_id, instance_peer, egress_contexts, enforces_limits)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, 'online', true, $17, 1,
        now(), now(), $18, NULLIF($19, ''), $20, $21, $22)
ON CONFLICT (id) DO UPDATE SET
    name = EXCLUDED.name, pool = EXCLUDED.pool, arch = EXCLUDED.arch,
    labels = CASE WHEN nodes.labels_overridden THEN nodes.labels ELSE EXCLUDED.labels END,
    capabilities = EXCLUDED.capabilities,
    backends = EXCLUDED.backends, artifacts = EXCLUDED.artifacts, protocol_min = EXCLUDED.protocol_min,
    protocol_max = EXCLUDED.protocol_max, gpu_indexes = EXCLUDED.gpu_indexes,
    -- a node that shrank keeps what it already holds: allocatable never drops below reserved
    alloc_cpu_millis = GREATEST(EXCLUDED.alloc_cpu_millis, nodes.res_cpu_millis),
    alloc_memory_bytes = GREATEST(EXCLUDED.alloc_memory_bytes, nodes.res_memory_bytes),
    alloc_disk_bytes = GREATEST(EXCLUDED.alloc_disk_bytes, nodes.res_disk_bytes),
    alloc_gpus = GREATEST(EXCLUDED.alloc_gpus, nodes.res_gpus),
    alloc_slots = GREATEST(EXCLUDED.alloc_slots, nodes.res_slots),
    health = 'online', connected = true, gateway_id = EXCLUDED.gateway_id,
    session = nodes.session + 1, last_heartbeat_at = now(), connected_at = now(),
    agent_version = EXCLUDED.agent_version, instance_id = EXCLUDED.instance_id,
    instance_peer = EXCLUDED.instance_peer, egress_contexts = EXCLUDED.egress_contexts,
    enforces_limits = EXCLUDED.enforces_limits, updated_at = now()
WHERE nodes.revoked_at IS NULL
RETURNING id, session, draining, pg_notify('podium_dispatch', '')

-- node_instance_lock --
-- Before a Hello is recorded: the instance the node has now and when its last heartbeat was
-- recorded (the old instance's lease runs from no later than that), the row held until the Hello
-- is recorded, so two Hellos for one node are decided one after the other.
SELECT instance_id, instance_peer, last_heartbeat_at FROM nodes WHERE id = $1 FOR NO KEY UPDATE

-- instance_superseded_by --
SELECT superseded_by, superseded_at FROM node_instances
WHERE node_id = $1 AND instance_id = $2 AND superseded_at IS NOT NULL

-- instance_seen --
INSERT INTO node_instances (node_id, instance_id, peer) VALUES ($1, $2, $3)
ON CONFLICT (node_id, instance_id) DO UPDATE SET peer = EXCLUDED.peer

-- supersede_instance --
-- Instance $3 took over node $1 from instance $2. The attempts the new instance does not report
-- may still run under the old one until its fence deadline: its last recorded heartbeat ($4) plus
-- $5 seconds. Every replica is told (podium_superseded), so whichever holds the old stream closes it.
WITH s AS (
    UPDATE node_instances SET superseded_at = now(), superseded_by = $3
    WHERE node_id = $1 AND instance_id = $2 AND superseded_at IS NULL
), e AS (
    INSERT INTO node_events (node_id, kind, message, detail)
    VALUES ($1, 'superseded', $6, jsonb_build_object('old', $2::text, 'new', $3::text, 'old_peer', $7::text,
                                                     'new_peer', $8::text))
)
UPDATE nodes SET handover_until = GREATEST(handover_until, COALESCE($4::timestamptz, now()) + make_interval(secs => $5))
WHERE id = $1
RETURNING handover_until,
          pg_notify('podium_superseded', json_build_object('node', $1::text, 'old', $2::text, 'new', $3::text)::text)

-- defer_node_loss --
-- The attempts a new instance did not report wait for the old instance's fence deadline. No row:
-- the deadline has passed (by the database clock), and the node-loss policy may apply now.
UPDATE nodes SET handover_tokens = ARRAY(SELECT DISTINCT unnest(handover_tokens || $2::bigint[]) ORDER BY 1)
WHERE id = $1 AND handover_until > now()
RETURNING handover_until

-- undelivered_on_node --
-- Assignments no gateway has pushed to any stream yet: no agent instance can hold them.
SELECT fencing_token FROM attempts WHERE node_id = $1 AND state = 'assigned' AND delivered_at IS NULL

-- handover_due --
-- Attempts whose old instance's fence deadline has passed and that are still where it left them: the
-- nodes handing over first (migration 0017's index), then the live tasks of each by its own index
-- (OFFSET 0 keeps the planner from reading every live task to join them instead).
SELECT t.id, t.state, t.fencing_token, t.attempts, t.max_attempts, t.requeue_on_node_loss, t.node_id
FROM nodes n CROSS JOIN LATERAL (
    SELECT id, state, fencing_token, attempts, max_attempts, requeue_on_node_loss, node_id FROM tasks
    WHERE tasks.node_id = n.id AND tasks.state IN ('assigned', 'provisioning', 'running', 'cancelling') OFFSET 0) t
WHERE cardinality(n.handover_tokens) > 0 AND n.handover_until <= now() AND t.fencing_token = ANY(n.handover_tokens)
LIMIT $1

-- handover_done --
-- Forget the tokens of handovers whose deadline has passed once their tasks have been dealt with
-- (a token whose task still sits on the node is kept: the next sweep tries again).
UPDATE nodes n SET handover_tokens = ARRAY(
    SELECT tok FROM unnest(n.handover_tokens) AS tok
    WHERE EXISTS (SELECT 1 FROM tasks t WHERE t.node_id = n.id AND t.fencing_token = tok
                  AND t.state IN ('assigned', 'provisioning', 'running', 'cancelling')))
WHERE cardinality(n.handover_tokens) > 0 AND n.handover_until <= now()
RETURNING n.id

-- node_event --
INSERT INTO node_events (node_id, kind, message, detail) VALUES ($1, $2, $3, $4)

-- node_events --
SELECT id, at, kind, message, detail FROM node_events WHERE node_id = $1 AND id > $2 ORDER BY id LIMIT $3

-- heartbeats --
-- One statement for every heartbeat a gateway received since its last flush. Health comes back to
-- online (a node that talks again is reachable again); only the node's current session counts.
-- Rows are locked in id order, the order placement and a group commit of node reports take them in,
-- so this can wait behind them (milliseconds) but never deadlock with them. It must not skip a busy
-- row: on a busy fleet a node's row is nearly always held by some batch, and a heartbeat skipped
-- every time is a healthy node declared unreachable. A node that was not online (unreachable: it
-- could not talk) is a node placement may use again: the dispatchers are woken for it ('': a node
-- changed), once for the flush, so a task that waited for it is not left until the tick.
WITH d AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS d(id, session)),
locked AS (
    SELECT n.id, n.health <> 'online' AS back FROM nodes n JOIN d ON d.id = n.id AND d.session = n.session
    WHERE n.revoked_at IS NULL
    ORDER BY n.id
    FOR NO KEY UPDATE OF n
), u AS (
    UPDATE nodes n SET last_heartbeat_at = now(), health = 'online', connected = true, gateway_id = $3
    FROM locked WHERE n.id = locked.id
    RETURNING n.id
), woke AS (
    SELECT count(pg_notify('podium_dispatch', '')) AS n FROM (SELECT 1 FROM locked WHERE back LIMIT 1) x
)
SELECT u.id, (SELECT n FROM woke) AS woke FROM u

-- node_disconnected --
UPDATE nodes SET connected = false, gateway_id = NULL, updated_at = now()
WHERE id = $1 AND session = $2

-- release_gateway --
-- A gateway shutting down lets go of all its nodes at once.
UPDATE nodes SET connected = false, gateway_id = NULL, updated_at = now() WHERE gateway_id = $1

-- mark_unreachable --
-- Rows locked in id order, skipping any another transaction holds (the next sweep takes them): the
-- watchdog never deadlocks with placement or heartbeats.
WITH c AS (
    SELECT id FROM nodes WHERE health = 'online' AND last_heartbeat_at < now() - make_interval(secs => $1)
    ORDER BY id FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE nodes n SET health = 'unreachable', updated_at = now() FROM c WHERE n.id = c.id
RETURNING n.id

-- mark_offline --
WITH c AS (
    SELECT id FROM nodes WHERE health <> 'offline' AND last_heartbeat_at < now() - make_interval(secs => $1)
    ORDER BY id FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE nodes n SET health = 'offline', connected = false, updated_at = now() FROM c WHERE n.id = c.id
RETURNING n.id

-- lock_nodes --
-- Placement takes its nodes' rows in id order before reserving on them, so two schedulers reserving
-- on overlapping nodes wait for each other instead of deadlocking.
SELECT id FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR NO KEY UPDATE

-- lock_nodes_drawing_tokens --
-- Placement takes its nodes' rows in id order, as lock_nodes does, and draws $2 new fencing tokens in
-- the same round trip: a pass that sends its Assigns before it writes them knows their tokens before
-- its write (`assign_tasks` takes them).
WITH locked AS (SELECT id FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR NO KEY UPDATE)
SELECT (SELECT count(*) FROM locked) AS locked,
       ARRAY(SELECT nextval('fencing_tokens') FROM generate_series(1, $2::int)) AS tokens

-- placement_nodes --
-- Every node placement could use, with the GPU indexes its live attempts hold.
SELECT n.*, ARRAY(SELECT g.gpu_index FROM gpu_claims g WHERE g.node_id = n.id) AS gpus_in_use
FROM nodes n
WHERE n.connected AND n.revoked_at IS NULL

-- list_nodes --
SELECT *, podium_drain_phase(id, draining) AS drain_phase FROM nodes ORDER BY name, id

-- list_nodes_page --
-- One page of nodes by (name, id) after the cursor ($1, $2); the first page passes NULLs.
SELECT *, podium_drain_phase(id, draining) AS drain_phase FROM nodes
WHERE $1::text IS NULL OR (name, id) > ($1::text, $2::text)
ORDER BY name, id
LIMIT $3

-- count_nodes_after --
SELECT count(*) FROM (
  SELECT 1 FROM nodes WHERE $1::text IS NULL OR (name, id) > ($1::text, $2::text) LIMIT $3
) x

-- nodes_by_prefix --
-- Nodes whose id or name starts with $1, when no node has it as its whole id or name.
SELECT *, podium_drain_phase(id, draining) AS drain_phase FROM nodes
WHERE starts_with(id, $1) OR starts_with(name, $1) ORDER BY name, id LIMIT $2

-- get_node --
SELECT *, podium_drain_phase(id, draining) AS drain_phase FROM nodes
WHERE id = $1 OR name = $1 ORDER BY (id = $1) DESC LIMIT 2

-- set_draining --
-- A drain's deadline ($3 seconds from now by the database clock; NULL: none); undrain clears it.
UPDATE nodes SET draining = $2, updated_at = now(), revision = revision + 1,
    drain_deadline = CASE WHEN $2 AND $3::float8 IS NOT NULL THEN now() + make_interval(secs => $3::float8) END
WHERE id = $1
RETURNING id, pg_notify('podium_dispatch', '')

-- drain_overdue --
-- Tasks still on a draining node whose drain deadline has passed: the watchdog applies the
-- node-loss policy to them. A task already being cancelled is left to the cancel's own grace. The
-- draining nodes first (migration 0017's index), then the live tasks of each by its own index (OFFSET
-- 0 keeps the planner from reading every live task to join them instead).
SELECT t.id, t.state, t.fencing_token, t.attempts, t.max_attempts, t.requeue_on_node_loss, t.cancel_reason,
       t.node_id
FROM nodes n CROSS JOIN LATERAL (
    SELECT id, state, fencing_token, attempts, max_attempts, requeue_on_node_loss, cancel_reason, node_id FROM tasks
    WHERE tasks.node_id = n.id AND tasks.state IN ('assigned', 'provisioning', 'running') OFFSET 0) t
WHERE n.draining AND n.drain_deadline <= now()
LIMIT $1

-- node_outbox_pending --
SELECT DISTINCT node_id FROM attempts
WHERE (delivered_at IS NULL AND state = 'assigned') OR (stop_requested_at IS NOT NULL AND stop_sent_at IS NULL)

-- set_labels --
-- An operator's labels replace the agent's from now on (labels_overridden), and wake placement.
-- $3: the revision the operator read (If-Match), or NULL for any; a stale one changes nothing.
UPDATE nodes SET labels = $2, labels_overridden = true, updated_at = now(), revision = revision + 1
WHERE id = $1 AND ($3::bigint IS NULL OR revision = $3::bigint)
RETURNING id, revision, pg_notify('podium_dispatch', '')

-- node_revision --
SELECT revision FROM nodes WHERE id = $1

-- set_artifacts --
-- A node's Inventory: the image digests it holds now (placement prefers them). Only from the node's
-- current session, and never for a removed node.
UPDATE nodes SET artifacts = $3, updated_at = now()
WHERE id = $1 AND session = $2 AND revoked_at IS NULL AND artifacts IS DISTINCT FROM $3
RETURNING id
