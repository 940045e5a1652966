-- node_hello --
-- A node (re)connects: record its facts and capacity, take its session for this gateway.
INSERT INTO nodes (id, name, pool, arch, labels, capabilities, backends, artifacts, protocol_min,
                   protocol_max, gpu_indexes, alloc_cpu_millis, alloc_memory_bytes, alloc_disk_bytes,
                   alloc_gpus, alloc_slots, health, connected, gateway_id, session, last_heartbeat_at,
                   connected_at, agent_version, egress_contexts, enforces_limits)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, 'online', true, $17, 1,
        now(), now(), $18, $19, $20)
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
    agent_version = EXCLUDED.agent_version, egress_contexts = EXCLUDED.egress_contexts,
    enforces_limits = EXCLUDED.enforces_limits, updated_at = now()
WHERE nodes.revoked_at IS NULL
RETURNING id, session, draining, pg_notify('podium_dispatch', '')

-- heartbeats --
-- One statement for every heartbeat a gateway received since its last flush. Health comes back to
-- online (a node that talks again is reachable again); only the node's current session counts.
-- Rows are locked in id order, the order placement and a group commit of node reports take them in,
-- so this can wait behind them (milliseconds) but never deadlock with them. It must not skip a busy
-- row: on a busy fleet a node's row is nearly always held by some batch, and a heartbeat skipped
-- every time is a healthy node declared unreachable.
WITH d AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS d(id, session)),
locked AS (
    SELECT n.id FROM nodes n JOIN d ON d.id = n.id AND d.session = n.session
    WHERE n.revoked_at IS NULL
    ORDER BY n.id
    FOR NO KEY UPDATE OF n
)
UPDATE nodes n SET last_heartbeat_at = now(), health = 'online', connected = true, gateway_id = $3
FROM locked WHERE n.id = locked.id
RETURNING n.id

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

-- placement_nodes --
-- Every node placement could use, with the GPU indexes its live attempts hold.
SELECT n.*, ARRAY(SELECT g.gpu_index FROM gpu_claims g WHERE g.node_id = n.id) AS gpus_in_use
FROM nodes n
WHERE n.connected AND n.revoked_at IS NULL

-- placement_nodes_changed --
-- The rows placement reads (connected or not, so a node that left is dropped from memory) changed
-- by any transaction at or after the horizon; all of them when the horizon is NULL.
SELECT n.*, ARRAY(SELECT g.gpu_index FROM gpu_claims g WHERE g.node_id = n.id) AS gpus_in_use
FROM nodes n
WHERE $1::xid8 IS NULL OR n.changed_xid >= $1::xid8

-- snapshot_horizon --
-- Every transaction below this had ended when this statement's snapshot was taken.
SELECT pg_snapshot_xmin(pg_current_snapshot())

-- list_nodes --
SELECT * FROM nodes ORDER BY name, id

-- list_nodes_page --
-- One page of nodes by (name, id) after the cursor ($1, $2); the first page passes NULLs.
SELECT * FROM nodes
WHERE $1::text IS NULL OR (name, id) > ($1::text, $2::text)
ORDER BY name, id
LIMIT $3

-- count_nodes_after --
SELECT count(*) FROM (
  SELECT 1 FROM nodes WHERE $1::text IS NULL OR (name, id) > ($1::text, $2::text) LIMIT $3
) x

-- nodes_by_prefix --
-- Nodes whose id or name starts with $1, when no node has it as its whole id or name.
SELECT * FROM nodes WHERE starts_with(id, $1) OR starts_with(name, $1) ORDER BY name, id LIMIT $2

-- get_node --
SELECT * FROM nodes WHERE id = $1 OR name = $1 ORDER BY (id = $1) DESC LIMIT 2

-- set_draining --
UPDATE nodes SET draining = $2, updated_at = now() WHERE id = $1
RETURNING id, pg_notify('podium_dispatch', '')

-- node_outbox_pending --
SELECT DISTINCT node_id FROM attempts
WHERE (delivered_at IS NULL AND state = 'assigned') OR (stop_requested_at IS NOT NULL AND stop_sent_at IS NULL)

-- set_labels --
-- An operator's labels replace the agent's from now on (labels_overridden), and wake placement.
UPDATE nodes SET labels = $2, labels_overridden = true, updated_at = now() WHERE id = $1
RETURNING id, pg_notify('podium_dispatch', '')

-- set_artifacts --
-- A node's Inventory: the image digests it holds now (placement prefers them). Only from the node's
-- current session, and never for a removed node.
UPDATE nodes SET artifacts = $3, updated_at = now()
WHERE id = $1 AND session = $2 AND revoked_at IS NULL AND artifacts IS DISTINCT FROM $3
RETURNING id
