-- Queries of the event stream and the web UI (see migration 0010 for why events are read by
-- (txid, id) below the snapshot's xmin).

-- events_start --
-- Where a stream that wants only what happens from now on starts.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text AS txid

-- event_txid --
SELECT txid::text FROM task_events WHERE id = $1
UNION ALL
SELECT txid::text FROM node_states WHERE id = $1
LIMIT 1

-- _stream_events --
-- Events after the cursor ($1 txid, $2 id) whose transactions have all ended, in stream order.
-- $3: only ids above it (a resume from an id no longer stored); $4 limit. The filters are the one
-- row of <rows> (f): task, node, states (any of them), and whether task and node events are wanted.
-- The event hub, which wants everything, names constants there: the planner folds them away and
-- PostgreSQL keeps one generic plan for the statement. With the filters as parameters, whenever
-- more events followed the cursor than one read takes (a hub behind a burst), every plan made for
-- the parameters' values looked cheaper than the generic one, and the statement was planned anew
-- on every read: ~0.9 ms of a ~1.3 ms read of 30 events (20 reads, 20 plans made; now 5, then one).
WITH h AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS x)
SELECT u.kind, u.id, u.txid::text AS txid, u.at, u.task_id, u.task_name, u.from_state, u.state, u.reason, u.actor,
       u.fencing_token, u.attempt, u.node_id, u.health, u.connected, u.draining, u.revoked, u.labels,
       u.task_created_at
FROM (
    (SELECT 'task' AS kind, e.id, e.txid, e.at, e.task_id, t.name AS task_name, e.from_state, e.to_state AS state,
            e.reason, e.actor, e.fencing_token, a.attempt, a.node_id, NULL::text AS health, NULL::boolean AS connected,
            NULL::boolean AS draining, NULL::boolean AS revoked, NULL::jsonb AS labels,
            t.created_at AS task_created_at
     FROM __ROWS__ f
     CROSS JOIN task_events e
     LEFT JOIN tasks t ON t.id = e.task_id
     LEFT JOIN attempts a ON a.fencing_token = e.fencing_token
     WHERE f.tasks AND (e.txid, e.id) > ($1::text::xid8, $2::bigint) AND e.id > $3::bigint
       AND e.txid < (SELECT x FROM h)
       AND (f.task IS NULL OR e.task_id = f.task) AND (f.node IS NULL OR a.node_id = f.node)
       AND (f.states IS NULL OR e.to_state = ANY(f.states))
     ORDER BY e.txid, e.id LIMIT $4)
    UNION ALL
    (SELECT 'node', n.id, n.txid, n.at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, n.node_id, n.health,
            n.connected, n.draining, n.revoked, n.labels, NULL::timestamptz
     FROM __ROWS__ f
     CROSS JOIN node_states n
     WHERE f.nodes AND f.task IS NULL AND f.states IS NULL
       AND (n.txid, n.id) > ($1::text::xid8, $2::bigint) AND n.id > $3::bigint
       AND n.txid < (SELECT x FROM h)
       AND (f.node IS NULL OR n.node_id = f.node)
     ORDER BY n.txid, n.id LIMIT $4)
) u
ORDER BY u.txid, u.id
LIMIT $4

-- _events_held --
-- Whether events after the cursor are committed but held back behind an older open transaction: the
-- stream must look again soon, as that transaction may end without writing an event (no NOTIFY).
-- The first such event in stream order, not EXISTS: the planner turned EXISTS into a sequential scan
-- that read every stored event whenever none was held (every read of the event hub; 2.8 ms at 50,000
-- events and growing with the table), where this walks the (txid, id) index from the cursor.
WITH h AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS x)
SELECT (SELECT id FROM task_events WHERE (txid, id) > ($1::text::xid8, $2::bigint) AND txid >= (SELECT x FROM h)
        ORDER BY txid, id LIMIT 1) IS NOT NULL
    OR (SELECT id FROM node_states WHERE (txid, id) > ($1::text::xid8, $2::bigint) AND txid >= (SELECT x FROM h)
        ORDER BY txid, id LIMIT 1) IS NOT NULL

-- events_after --
-- filters: $5 task, $6 node, $7 task states (any of them); $8/$9 include task/node events
{{stream_events: (SELECT $5::uuid AS task, $6::text AS node, $7::text[] AS states, $8::boolean AS tasks, $9::boolean AS nodes)}}

-- hub_read --
-- The event hub's read, in one round trip: events_after's rows, and after them one row of kind 'held'
-- when events after the cursor are held back (events_held). An event held back comes after every
-- event read (its transaction is at or past the horizon, theirs before it), so the cursor read from
-- is the one to look after. The held row sorts last (its txid is null).
SELECT x.* FROM (
    SELECT r.* FROM ({{stream_events: (SELECT NULL::uuid AS task, NULL::text AS node, NULL::text[] AS states, true AS tasks, true AS nodes)}}) r
    UNION ALL
    SELECT 'held', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL, NULL
    WHERE ({{events_held: }})
) x
ORDER BY x.txid::xid8 NULLS LAST, x.id
-- ui_tasks_page --
-- Newest first, keyset-paged by (created_at, id): a page after ($1, $2) costs the same at any depth.
SELECT id, name, state, reason, node_id, attempts, max_attempts, exit_code, created_at, finished_at, spec->'labels' AS labels
FROM tasks
WHERE ($1::timestamptz IS NULL OR (created_at, id) < ($1, $2::uuid))
  AND ($3::text IS NULL OR state = $3)
  AND ($4::text IS NULL OR name = $4)
  AND ($5::text IS NULL OR node_id = $5)
  AND ($6::jsonb IS NULL OR spec->'labels' @> $6)
ORDER BY created_at DESC, id DESC
LIMIT $7

-- ui_spec_revisions --
SELECT * FROM named_specs WHERE name = $1 ORDER BY revision DESC LIMIT 100

-- ui_session_insert --
-- (expired sessions go at every sign-in, so the table never holds more than a day of them)
WITH gone AS (DELETE FROM ui_sessions WHERE expires_at < now())
INSERT INTO ui_sessions (id, token_id, csrf, expires_at) VALUES ($1, $2, $3, now() + make_interval(secs => $4))

-- ui_session_get --
SELECT s.token_id, s.csrf, k.name, k.role
FROM ui_sessions s JOIN api_tokens k ON k.id = s.token_id
WHERE s.id = $1 AND s.expires_at > now() AND k.revoked_at IS NULL

-- ui_session_delete --
DELETE FROM ui_sessions WHERE id = $1 OR expires_at < now()
