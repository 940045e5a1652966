-- Every statement that reads or writes tasks, attempts, events and logs, as named blocks.
-- `podium.store.db.Store` is the only code that runs them.

-- insert_tasks --
-- Submissions (one, or a batch) in one statement: each task, its first event and its audit entry,
-- one NOTIFY for dispatch unless $4 says not (a dispatch pass storing them claims them itself), and one for the resolver loop only if a task has an image tag to resolve
-- (every other wake-up of it would be a query that finds nothing, on the way of every submit's
-- placement). ON CONFLICT on the idempotency key makes a retried submit return no row for it; the
-- caller then reads the task the first submit created. (Its predicate lets the key's UNIQUE constraint
-- be replaced by a partial index of the keys alone later: see migration 0014.)
-- $1: the tasks as one JSON array of arrays (`Submissions.rows`: id, name, spec as JSON text, priority,
-- cpu, memory, disk, gpus, timeout, max_attempts, requeue_on_node_loss, idempotency key, spec name,
-- spec revision): an array parameter per column cost the client a type check and an encoding call per
-- element. $2 the reason a queued task waits for, $3 who submitted them.
WITH {{stored_tasks: $1 | $2 | $3 | $4}}
SELECT t.*, (SELECT count(*) FROM n) + (SELECT count(*) FROM r) AS notified FROM t

-- tasks_by_ids --
SELECT * FROM tasks WHERE id = ANY($1::uuid[])

-- tasks_by_idempotency_keys --
SELECT * FROM tasks WHERE idempotency_key = ANY($1::text[])

-- task_by_idempotency_key --
SELECT * FROM tasks WHERE idempotency_key = $1

-- transition_tasks --
-- The one compare-and-set every state change goes through, for one task or for many in one statement
-- (a group commit of node reports); each row of the input is its own compare-and-set with its own
-- answer. Per row: `from_state` is the expected state; `token` and `node` are checked when a node is
-- the actor. A row that matches nothing was rejected and changed nothing. `end_attempt` ends the
-- current attempt with that attempt state, freeing its capacity exactly once; `attempt_state` moves
-- it forward instead (provisioning, running); `stop` asks the node to stop it. At most one row per task
-- (`Store.transition_many` runs it once per layer for a batch with several changes of one task).
-- An end carries its failure class and the words beside its reason (`detail`). A container attempt's
-- end frees its capacity only if its release proof is already recorded, or `release` says the
-- node-loss policy gave up on the node (then the proof says so); otherwise it stays reserved until
-- `release_proofs`. `backend_ref` is recorded on the attempt as it moves forward (with RUNNING).
-- `revision`, when given, is the assignment revision the caller read (If-Match): another one refuses
-- the row too. Every accepted row bumps the task's revision. `via` ('running' or null) is a state the
-- task passes through on its way from `from_state` to an end, in the same row: a short command's
-- `running` and its end, read in one batch. It is recorded as its own event (with no reason of its
-- own), before the end's, and as the attempt's start; the task row is written once.
WITH {{transitions: $1 | $2}}
-- one row per change made, and nothing read per row from `ended` or `moved`: a CTE has no index, so
-- a lookup in them for each row would be a scan for each row: quadratic in the batch, 20 ms of the
-- database's CPU at 930 rows (tests/integration/test_plans.py keeps it out)
SELECT t.id, t.fencing_token,
       (SELECT n FROM woke_node) AS woke_node, (SELECT n FROM woke_dispatch) AS woke_dispatch,
       EXISTS (SELECT 1 FROM operation_freed) AS operations_freed
FROM t

-- transition_tasks_storing_logs --
-- transition_tasks ($1, $2) with output chunks stored in the same statement ($3–$9, as insert_logs
-- takes them), committed on its own: a node's end decided on what its task's row is expected to hold
-- (`Store.end_expected`), made with the output sent before it in one round trip, where a group commit
-- takes four (BEGIN, the read, the write, COMMIT). The followers' NOTIFY is read on an outer join's
-- preserved side, so it is sent when the change is refused too (the chunks are stored all the same):
-- one row of nulls then.
WITH {{stored_logs: $3::uuid[], $4::bigint[], $5::text[], $6::bigint[], $7::bigint[], $8::bytea[], $9::text[]}},
{{transitions: $1 | $2}}
SELECT t.id, t.fencing_token,
       (SELECT n FROM woke_node) AS woke_node, (SELECT n FROM woke_dispatch) AS woke_dispatch,
       EXISTS (SELECT 1 FROM operation_freed) AS operations_freed
FROM (SELECT count(*) FROM told) z LEFT JOIN t ON true

-- _transitions --
-- transition_tasks' changes (the rows __1__, waking the dispatcher if __2__), as CTEs: `t` the tasks
-- changed; `woke_node`, `woke_dispatch` and `operation_freed` for the including statement to read.
d AS (
    -- the rows come as one JSON array of arrays (`Change.row`'s order), not as eighteen arrays: an
    -- array parameter costs the client a type check and an encoding call per element, four times the
    -- CPU of the whole JSON for a batch of reports
    SELECT (v->>0)::uuid AS id, v->>1 AS from_state, v->>2 AS to_state, v->>3 AS reason, (v->>4)::bigint AS token,
           v->>5 AS node, (v->>6)::int AS exit_code, (v->>7)::float8 AS lease, v->>8 AS end_attempt,
           v->>9 AS attempt_state, (v->>10)::boolean AS stop, v->>11 AS actor, v->>12 AS failure_class,
           v->>13 AS detail, v->>14 AS backend_ref, (v->>15)::boolean AS release, (v->>16)::bigint AS revision,
           v->>17 AS via
    FROM jsonb_array_elements(__1__::jsonb) AS r(v)
), t AS (
    UPDATE tasks SET
        state = d.to_state,
        revision = tasks.revision + 1,
        reason = d.reason,
        reason_detail = d.detail,
        exit_code = CASE WHEN d.exit_code IS NULL THEN tasks.exit_code ELSE d.exit_code END,
        lease_expires_at = CASE
            WHEN d.end_attempt IS NOT NULL THEN NULL
            WHEN d.lease IS NULL THEN tasks.lease_expires_at
            WHEN d.lease < 0 THEN NULL
            ELSE now() + make_interval(secs => d.lease) END,
        accept_deadline = CASE WHEN d.to_state = 'assigned' THEN tasks.accept_deadline ELSE NULL END,
        started_at = CASE
            WHEN d.end_attempt IS NOT NULL THEN NULL
            WHEN d.to_state = 'running' AND tasks.started_at IS NULL THEN now()
            ELSE tasks.started_at END,
        cancel_requested_at = CASE WHEN d.to_state = 'cancelling' THEN now()
                                   WHEN d.to_state = 'queued' THEN NULL ELSE tasks.cancel_requested_at END,
        cancel_reason = CASE WHEN d.to_state = 'cancelling' THEN d.reason
                             WHEN d.to_state = 'queued' THEN NULL ELSE tasks.cancel_reason END,
        node_id = CASE WHEN d.end_attempt IS NOT NULL THEN NULL ELSE tasks.node_id END,
        finished_at = CASE WHEN d.to_state IN ('succeeded', 'failed', 'cancelled', 'lost') THEN now() ELSE NULL END,
        updated_at = now()
    FROM d
    -- the ids once more as an index condition of their own: a batch is estimated at 100 rows, and a
    -- plan made while the table was small hashes it against a whole index of `tasks` otherwise, read
    -- again on every run as the table grows (~250 rows for each task placed in a 5,000-task burst)
    WHERE tasks.id = d.id AND tasks.id = ANY(ARRAY(SELECT id FROM d)) AND tasks.state = d.from_state
      AND (d.token IS NULL OR tasks.fencing_token = d.token)
      AND (d.node IS NULL OR tasks.node_id = d.node)
      AND (d.revision IS NULL OR tasks.revision = d.revision)
    RETURNING tasks.id, tasks.fencing_token, d.from_state, d.to_state, d.reason, d.exit_code, d.end_attempt,
              d.attempt_state, d.stop, d.actor, d.failure_class, d.detail, d.backend_ref, d.release, d.via
), ended AS (
    -- an attempt ends once (finished_at); whether that also frees its capacity depends on its backend:
    -- a process group is gone with its end, a container only once the node proves it removed
    UPDATE attempts a SET
        state = t.end_attempt, finished_at = now(), reason = t.reason,
        failure_class = t.failure_class, failure_detail = t.detail,
        released = (a.backend_kind <> 'container' OR t.release OR a.release_proof IS NOT NULL),
        released_at = CASE WHEN a.backend_kind <> 'container' OR t.release OR a.release_proof IS NOT NULL
                           THEN now() END,
        release_proof = CASE WHEN a.backend_kind = 'container' AND a.release_proof IS NULL AND t.release
                             THEN jsonb_build_object('by', 'server', 'reason', t.reason) ELSE a.release_proof END,
        exit_code = CASE WHEN t.exit_code IS NULL THEN a.exit_code ELSE t.exit_code END,
        stop_requested_at = CASE WHEN t.stop THEN now() ELSE a.stop_requested_at END,
        started_at = CASE WHEN t.via = 'running' THEN now() ELSE a.started_at END,
        backend_ref = COALESCE(t.backend_ref, a.backend_ref)
    FROM t
    -- `(… IS NULL) IS TRUE`, not `… IS NULL`: the same test, but one the planner does not match with
    -- the partial index attempts_reconcile_due (WHERE finished_at IS NULL). Matched, a plan made while
    -- the table was small reads that whole index on every run (its dead entries too), instead of
    -- finding each attempt by its fencing token
    WHERE t.end_attempt IS NOT NULL AND a.fencing_token = t.fencing_token AND (a.finished_at IS NULL) IS TRUE
    RETURNING a.task_id, a.node_id, a.cpu_millis, a.memory_bytes, a.disk_bytes, a.gpus, a.fencing_token, t.stop,
              a.released
), unclaimed AS (
    DELETE FROM gpu_claims g USING ended WHERE g.fencing_token = ended.fencing_token AND ended.gpus > 0 AND ended.released
), moved AS (
    UPDATE attempts a SET
        state = COALESCE(t.attempt_state, a.state),
        backend_ref = COALESCE(t.backend_ref, a.backend_ref),
        provisioning_at = CASE WHEN t.attempt_state = 'provisioning' THEN now() ELSE a.provisioning_at END,
        started_at = CASE WHEN t.attempt_state = 'running' THEN now() ELSE a.started_at END,
        stop_requested_at = CASE WHEN t.stop THEN now() ELSE a.stop_requested_at END,
        stop_sent_at = CASE WHEN t.stop THEN NULL ELSE a.stop_sent_at END
    FROM t
    WHERE t.end_attempt IS NULL AND (t.attempt_state IS NOT NULL OR t.stop) AND a.fencing_token = t.fencing_token
    RETURNING a.task_id, a.node_id, t.stop, t.attempt_state = 'running' AS started
), operation_freed AS (
    -- An attempt that starts running frees one of its node's provisioning operations. A task that
    -- waits for nothing else (its node's `max_operations` below its slots, all of them in use) is a
    -- pass's to place now, not at the tick. A node whose slots bind first frees nothing placement
    -- waits for by a start: left out, so a start on it wakes no dispatcher
    SELECT 1 FROM moved m JOIN nodes n ON n.id = m.node_id
    WHERE m.started AND n.max_operations < n.alloc_slots
    LIMIT 1
), {{freed: ended WHERE ended.released}}, e AS (
    -- a row's `via` event first (ids in this order: a stream reads a task's events in id order)
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor, fencing_token, failure_class, detail)
    SELECT t.id, v.from_state, v.to_state, v.reason, t.actor, t.fencing_token, v.failure_class, v.detail
    FROM t CROSS JOIN LATERAL (VALUES (0, t.from_state, t.via, NULL, NULL, NULL),
                                      (1, COALESCE(t.via, t.from_state), t.to_state, t.reason, t.failure_class, t.detail))
         AS v(k, from_state, to_state, reason, failure_class, detail)
    WHERE v.k = 1 OR t.via IS NOT NULL
    ORDER BY t.id, v.k
), woke_node AS (
    -- wake the gateway of every node that must send a stop, and the dispatcher once when room was
    -- freed or work was queued; delivered only if the transaction commits
    SELECT count(pg_notify('podium_node', x.node_id)) AS n
    FROM (SELECT DISTINCT node_id FROM (SELECT node_id, stop FROM ended UNION ALL SELECT node_id, stop FROM moved) y
          WHERE y.stop) x
), woke_dispatch AS (
    -- (__2__ false: the caller places on the room its changes free in the same transaction, and wakes
    -- the dispatcher itself if that leaves anything for a pass, `Store.transition_decided`, told of a
    -- freed operation by `operations_freed`). Said 'room' when the changes only freed capacity (or an
    -- operation): a dispatcher that knows its queue drained need not look (`Dispatcher._pass`); ''
    -- when they queued a task, which any dispatcher must look for
    SELECT count(pg_notify('podium_dispatch', z.why)) AS n
    FROM (SELECT CASE WHEN EXISTS (SELECT 1 FROM t WHERE t.to_state = 'queued') THEN '' ELSE 'room' END AS why
          WHERE __2__::boolean AND (EXISTS (SELECT 1 FROM freed) OR EXISTS (SELECT 1 FROM t WHERE t.to_state = 'queued')
                                 OR EXISTS (SELECT 1 FROM operation_freed))) z
)

-- lock_tasks --
-- A batch of changes takes its task rows in id order (and then its nodes', with lock_nodes), the
-- order a single change takes them in (its task, then its node): batches, single changes and
-- placement never wait for each other in a cycle.
SELECT id FROM tasks WHERE id = ANY($1::uuid[]) ORDER BY id FOR NO KEY UPDATE

-- lock_nodes_of_tasks --
SELECT n.id FROM nodes n
WHERE n.id IN (SELECT node_id FROM tasks WHERE id = ANY($1::uuid[]) AND node_id IS NOT NULL)
ORDER BY n.id FOR NO KEY UPDATE

-- claim_queued --
-- The dispatch claim. SKIP LOCKED lets several schedulers claim disjoint batches at once. `avoid` is
-- the nodes earlier attempts were lost on, revoked from or failed on: placement tries others first.
-- A container task is claimed only once its image is resolved to a digest (the resolver loop): what
-- a node is assigned must already name exactly one image. A pass claims in chunks, in this order;
-- $2 is what it claimed already (its own locks are not skipped by SKIP LOCKED). The spec comes as
-- its text: the dispatcher decodes a spec it has not seen before only (the same rows come back at
-- every look at the whole window).
--
-- A claim that comes up short (fewer than $1 rows) also says whether it passed over a queued task
-- another transaction holds: one more row, last, its id NULL and `held` true. SKIP LOCKED hides such a
-- task (under a release proof's or a group commit's lock, or another replica's claim), and a short
-- claim is otherwise the dispatcher's proof that the queue is drained: believed, every end's wake-up
-- after it is answered with no pass, and the task waits for the tick once the lock is let go. The
-- look is a plain read of the same queue (it waits for no lock, and sees a held row as it was last
-- committed); a claim that filled its limit makes none.
--
-- $3 are the nodes a pass placed its new tasks ($4) on before its transaction (`Store._present`): a
-- claim that comes up short with none but those tasks also takes those nodes' locks, in id order, after
-- every task's (`c` is read whole first), and says so (`locked`, on every row): the pass then places
-- on those nodes alone, and needs no statement of its own to lock them. Any other claim locks none:
-- a pass that places elsewhere too locks all its nodes at once, in id order, as it always did.
WITH {{claimable: $1 | $2}},
{{claim_locks: c | $1 | $3 | $4}}
{{claimed_rows: c | $1 | $2}}
-- claim order (a materialized CTE's rows come back in no order SQL promises), the marker last
ORDER BY held, priority DESC, created_at, id

-- insert_tasks_claiming --
-- A pass's submission stored ($5–$7, as insert_tasks takes them, no dispatcher woken: this pass claims
-- them) and its first claim ($1–$4, as claim_queued takes them) in one statement: one round trip where
-- the two were two, on the way of every submission a pass stores. A statement does not see the rows its
-- own CTEs insert, so the new tasks (none of them locked by anyone else: no other transaction sees
-- them) are merged into the claim of the queue as it was (`c`) in claim order, and cut to its limit;
-- a new task left out, or one that is not claimable yet (an image to resolve), stays queued for the
-- pass's next claim or the next pass, as a task claim_queued passed over. A queued task `c` locked and
-- the cut left out (new tasks outranked it) stays locked by this pass, unclaimed: its next claim returns
-- it (SKIP LOCKED does not skip a transaction's own locks), else its COMMIT lets it go. The tasks as
-- stored come last, one whole row each (`stored`, `held` null), for the submission's answer: so every
-- column of `tasks` must be of a type the driver reads in binary (a migration that changes the table
-- fails this statement once on a server that had read the row's type, as a lost connection would).
WITH {{stored_tasks: $5 | $6 | $7 | false}},
{{claimable: $1 | $2}},
m AS (
    SELECT * FROM c
    UNION ALL
    SELECT t.id, t.spec::text, t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, t.reason, t.image_digest,
           t.attempts, '{}'::text[], t.priority, t.created_at
    FROM t WHERE t.image IS NULL OR t.image_digest IS NOT NULL
    ORDER BY priority DESC, created_at, id
    LIMIT $1
),
{{claim_locks: m | $1 | $3 | $4}}
SELECT x.*, NULL::tasks AS stored, NULL::bigint AS notified FROM ({{claimed_rows: m | $1 | $2}}) x
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, ROW(t.*)::tasks,
       (SELECT count(*) FROM r)
FROM t
ORDER BY held, priority DESC, created_at, id

-- assign_tasks --
-- A dispatch pass's whole write, one statement: the reservation on each node, then the batched form
-- of transition_task(queued → assigned) for the placements on the nodes that had room.
--
-- The reservation ($7–$12, one row per node) takes capacity only where the node still has it: a node
-- another scheduler filled first is simply not reserved, and its tasks stay queued for the next pass.
-- Its rows were locked (lock_nodes) before this statement began, so its snapshot holds every attempt
-- the schedulers that held them committed: the capacity operations (every placement is one until its
-- attempt runs) are counted from those, and no two schedulers exceed a node's `max_operations`.
--
-- Each assignment is one attempt, one new fencing token, a lease and an accept deadline, and an
-- event. The attempt records what it was decided on: the node as placement saw it (in $1, with the
-- node's materializations as they are now), and its retry count and limit; its first reconcile is due
-- $5 seconds from now. $6 are the nodes whose streams the dispatching server holds: their attempts are
-- marked delivered here and come back with what the Assign carries (attempt, GPU indexes, pinned
-- spec), pushed by that server as soon as this commits, with no outbox take; a push that then fails is
-- repaired as a take's is (the node's next Hello redelivers). Every other node is told by NOTIFY
-- podium_node.
--
-- $13 are acceptances the nodes sent already (`Store._claim_and_assign`: their Assigns went out before
-- this write), each [fencing token, node, actor, lease seconds]: an assignment whose token and node one
-- names is written accepted, as transition_tasks(assigned → provisioning) would make it after this
-- statement — the task `provisioning` (its revision moved twice, no accept deadline, the acceptance's
-- lease), the attempt `provisioning` (keeping the deadline it had), and both events in order — in
-- the round trip of the write, not one of its own.
--
-- One row for each node reserved (its id alone: the caller refuses the whole write when a
-- claimed task on one was no longer queued), and one for each assignment. Not a join of the two: the
-- planner knows no CTE's size, and joined them in a nested loop, every reserved node against every
-- assignment (250,000 comparisons, ~40 ms of a 146 ms write, for a pass of 500 on 500 nodes).
WITH r AS (
    UPDATE nodes n SET
        res_cpu_millis = n.res_cpu_millis + c.cpu,
        res_memory_bytes = n.res_memory_bytes + c.mem,
        res_disk_bytes = n.res_disk_bytes + c.disk,
        res_gpus = n.res_gpus + c.gpus,
        res_slots = n.res_slots + c.slots
    FROM unnest($7::text[], $8::bigint[], $9::bigint[], $10::bigint[], $11::int[], $12::int[])
         AS c(id, cpu, mem, disk, gpus, slots)
    WHERE n.id = c.id
      AND n.connected AND n.health = 'online' AND NOT n.draining AND n.revoked_at IS NULL
      AND (SELECT count(*) FROM attempts a WHERE a.node_id = n.id AND a.finished_at IS NULL
             AND a.state IN ('assigned', 'provisioning')) + c.slots <= n.max_operations
      AND n.res_cpu_millis + c.cpu <= n.alloc_cpu_millis
      AND n.res_memory_bytes + c.mem <= n.alloc_memory_bytes
      AND n.res_disk_bytes + c.disk <= n.alloc_disk_bytes
      AND n.res_gpus + c.gpus <= n.alloc_gpus
      AND n.res_slots + c.slots <= n.alloc_slots
    RETURNING n.id
), d AS (
    -- the placements as one JSON array of arrays (an array parameter per column cost the client a type
    -- check and an encoding call per element): task, node, GPU indexes ("0,1"), the node as seen, and
    -- the fencing token drawn for it already (`lock_nodes_drawing_tokens`), or null to draw one here
    SELECT (v->>0)::uuid AS id, v->>1 AS node_id, v->>2 AS gpu_indexes, v->3 AS snapshot, (v->>4)::bigint AS token,
           ac.actor AS accepted_by, ac.lease AS accepted_lease
    FROM jsonb_array_elements($1::jsonb) AS p(v)
    LEFT JOIN (SELECT (x->>0)::bigint AS token, x->>1 AS node_id, x->>2 AS actor, (x->>3)::float8 AS lease
               FROM jsonb_array_elements($13::jsonb) AS k(x)) ac
           ON ac.token = (v->>4)::bigint AND ac.node_id = v->>1
    WHERE v->>1 IN (SELECT id FROM r)
), t AS (
    UPDATE tasks SET
        state = CASE WHEN d.accepted_by IS NULL THEN 'assigned' ELSE 'provisioning' END, reason = NULL,
        node_id = d.node_id, revision = tasks.revision + CASE WHEN d.accepted_by IS NULL THEN 1 ELSE 2 END,
        fencing_token = COALESCE(d.token, nextval('fencing_tokens')), attempts = tasks.attempts + 1,
        -- clock_timestamp(), not now(): a transaction that was slow between its claim and this write
        -- must not hand out an assignment with its accept window already spent
        accept_deadline = CASE WHEN d.accepted_by IS NULL THEN clock_timestamp() + make_interval(secs => $2) END,
        lease_expires_at = CASE WHEN d.accepted_by IS NULL OR d.accepted_lease IS NULL
                                THEN clock_timestamp() + make_interval(secs => $3)
                                WHEN d.accepted_lease < 0 THEN NULL
                                ELSE now() + make_interval(secs => d.accepted_lease) END,
        exit_code = NULL, started_at = NULL, cancel_requested_at = NULL, cancel_reason = NULL,
        -- (what an acceptance clears besides)
        reason_detail = CASE WHEN d.accepted_by IS NULL THEN tasks.reason_detail END,
        finished_at = CASE WHEN d.accepted_by IS NULL THEN tasks.finished_at END,
        updated_at = now()
    FROM d
    -- `(… = 'queued') IS TRUE`, not `… = 'queued'`: the same test, but one the planner does not match
    -- with the partial index tasks_queued. Matched, it guessed `d` one row (a CTE's size is unknown)
    -- and, for each placement, read the queue's head in that index until it found the task: the
    -- claimed tasks are that head, so a pass of 500 read 125,000 index entries (172 of a 212 ms
    -- write). Each task is found by its primary key instead
    WHERE tasks.id = d.id AND (tasks.state = 'queued') IS TRUE
    RETURNING tasks.id, tasks.node_id, tasks.fencing_token, tasks.attempts, tasks.cpu_millis,
              tasks.memory_bytes, tasks.disk_bytes, tasks.gpus, d.gpu_indexes, d.accepted_by,
              COALESCE(tasks.accept_deadline, clock_timestamp() + make_interval(secs => $2)) AS accept_deadline,
              COALESCE(tasks.spec->>'backend', 'process') AS backend_kind, d.snapshot, tasks.max_attempts,
              COALESCE(string_to_array(NULLIF(d.gpu_indexes, ''), ',')::int[], '{}') AS gpus_given,
              tasks.node_id = ANY($6::text[]) AS here, tasks.spec, tasks.image, tasks.image_digest
), a AS (
    INSERT INTO attempts (task_id, attempt, fencing_token, node_id, state, cpu_millis, memory_bytes,
                          disk_bytes, gpus, gpu_indexes, accept_deadline, backend_kind, capability_snapshot,
                          retry_count, retry_limit, next_reconcile_at, delivered_at, provisioning_at)
    SELECT t.id, t.attempts, t.fencing_token, t.node_id, CASE WHEN t.accepted_by IS NULL THEN 'assigned' ELSE 'provisioning' END,
           t.cpu_millis, t.memory_bytes, t.disk_bytes,
           t.gpus, t.gpus_given, t.accept_deadline,
           t.backend_kind, t.snapshot || jsonb_build_object('materializations', n.materializations),
           t.attempts - 1, GREATEST(t.max_attempts - 1, 0), clock_timestamp() + make_interval(secs => $5),
           CASE WHEN t.here THEN now() END, CASE WHEN t.accepted_by IS NOT NULL THEN now() END
    FROM t JOIN nodes n ON n.id = t.node_id
), g AS (
    -- the primary key makes a GPU index impossible to hand out twice: a racing scheduler's whole
    -- batch fails and is retried on fresh state
    INSERT INTO gpu_claims (node_id, gpu_index, fencing_token)
    SELECT t.node_id, gi::int, t.fencing_token FROM t, unnest(string_to_array(NULLIF(t.gpu_indexes, ''), ',')) gi
), e AS (
    -- an accepted one's acceptance after its assignment (ids in this order: a stream reads a task's
    -- events in id order)
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor, fencing_token)
    SELECT t.id, v.from_state, v.to_state, NULL, v.actor, t.fencing_token
    FROM t CROSS JOIN LATERAL (VALUES (0, 'queued', 'assigned', $4::text),
                                      (1, 'assigned', 'provisioning', t.accepted_by)) AS v(k, from_state, to_state, actor)
    WHERE v.k = 0 OR t.accepted_by IS NOT NULL
    ORDER BY t.id, v.k
)
SELECT r.id AS reserved, NULL::uuid AS id, NULL::text AS node_id, NULL::bigint AS fencing_token, NULL::boolean AS here,
       NULL::int AS attempt, NULL::int[] AS gpu_indexes, NULL::text AS spec, NULL::boolean AS accepted
FROM r
UNION ALL
SELECT NULL, t.id, t.node_id, t.fencing_token, t.here, t.attempts, t.gpus_given, CASE WHEN t.here THEN {{pinned_spec: t}} END,
       t.accepted_by IS NOT NULL
FROM t

-- set_queued_reasons --
-- (a placement reason has no words beside it: any left from an earlier end go with the old reason)
UPDATE tasks SET reason = d.reason, reason_detail = NULL, updated_at = now()
FROM unnest($1::uuid[], $2::text[]) AS d(id, reason)
-- `IS TRUE` for the reason assign_tasks gives: each task by its primary key, not the whole queue
-- read from tasks_queued into a hash (17,000 entries for 2,000 reasons)
WHERE tasks.id = d.id AND (tasks.state = 'queued') IS TRUE
  AND (tasks.reason IS DISTINCT FROM d.reason OR tasks.reason_detail IS NOT NULL)

-- notify_nodes --
SELECT pg_notify('podium_node', n) FROM unnest($1::text[]) AS n

-- notify_dispatch --
SELECT pg_notify('podium_dispatch', '')

-- _pinned_spec --
-- The spec an Assign carries, as JSON text: a container task's image pinned to the digest it was
-- resolved to (repository@digest, the tag dropped, as `spec.pinned_image` writes it), so no retag
-- between attempts can change what runs. __ROWS__ has the task's spec, image and image_digest.
(CASE WHEN __ROWS__.image_digest IS NULL THEN __ROWS__.spec
      ELSE jsonb_set(__ROWS__.spec, '{image}', to_jsonb(
          regexp_replace(split_part(__ROWS__.image, '@', 1), ':[^/:]*$', '') || '@' || __ROWS__.image_digest))
 END)::text

-- take_outbox --
-- What a gateway owes a set of nodes: Assigns not yet pushed, and stops not yet sent. Marked as sent
-- in the same statement; a send that then fails is repaired by the node's next Hello. One statement
-- for every node woken since the last take. An Assign's spec is pinned (`_pinned_spec`). The attempt
-- rows are locked in (node, task) order, the order a group commit of node reports takes them in, so
-- the two never deadlock.
WITH due AS (
    SELECT a.fencing_token FROM attempts a
    WHERE a.node_id = ANY($1::text[])
      AND ((a.state = 'assigned' AND a.delivered_at IS NULL) OR (a.stop_requested_at IS NOT NULL AND a.stop_sent_at IS NULL))
    ORDER BY a.node_id, a.task_id
    FOR NO KEY UPDATE OF a
), assigns AS (
    UPDATE attempts a SET delivered_at = now()
    FROM due, tasks t
    WHERE a.fencing_token = due.fencing_token AND a.state = 'assigned' AND a.delivered_at IS NULL
      AND t.id = a.task_id AND t.fencing_token = a.fencing_token AND t.state = 'assigned'
    RETURNING a.node_id, a.task_id, a.attempt, a.fencing_token, a.gpu_indexes, {{pinned_spec: t}} AS spec
), stops AS (
    UPDATE attempts a SET stop_sent_at = now()
    FROM due
    WHERE a.fencing_token = due.fencing_token AND a.stop_requested_at IS NOT NULL AND a.stop_sent_at IS NULL
    RETURNING a.node_id, a.task_id, a.fencing_token, a.reason
)
SELECT 'assign' AS kind, node_id, task_id, attempt, fencing_token, gpu_indexes, spec, NULL AS reason FROM assigns
UNION ALL
SELECT 'stop', node_id, task_id, NULL, fencing_token, NULL, NULL, reason FROM stops
ORDER BY node_id, fencing_token

-- tasks_on_node --
SELECT id, state, fencing_token FROM tasks
WHERE node_id = $1 AND state IN ('assigned', 'provisioning', 'running', 'cancelling')

-- redeliver --
UPDATE attempts SET delivered_at = NULL WHERE fencing_token = ANY($1::bigint[]) AND state = 'assigned'

-- give_back_assigns --
-- Assigns marked delivered by the dispatch that placed them, whose node's stream was gone before
-- they could be pushed: undelivered again, and whichever replica holds the node now is woken.
WITH r AS (
    UPDATE attempts SET delivered_at = NULL
    WHERE fencing_token = ANY($1::bigint[]) AND state = 'assigned' AND delivered_at IS NOT NULL
    RETURNING node_id
)
SELECT count(pg_notify('podium_node', x.node_id)) FROM (SELECT DISTINCT node_id FROM r) x

-- request_stop --
-- Tell a node to stop an attempt it should not be running (a stale token it reported).
UPDATE attempts SET stop_requested_at = now(), stop_sent_at = NULL
WHERE fencing_token = ANY($1::bigint[]) AND node_id = $2

-- get_task --
SELECT * FROM tasks WHERE id = $1

-- lock_task_facts --
-- A group commit of node reports reads what it decides on under the lock it writes under: its tasks
-- locked in id order (the order a single change and placement take them in) and read; a row changed
-- meanwhile is read as committed. Then, in the same statement, the nodes of the tasks in $2 (those
-- with an end reported: the changes that free a node's capacity), in id order: every task's lock is
-- taken before the first node's (`t` is read whole by `n` before `n` sorts and locks), the order a
-- single change takes them in. The nodes are locked while the batch is decided (no round trip more
-- for them); a change that frees a node not locked here has it locked before it is written
-- (`Store.transition_decided`).
WITH {{facts_locked: }}
-- (`n` is named in the WHERE only to run it: a SELECT in WITH that nothing reads is never run; true
-- for every row, it runs once, and reading `t` whole takes every task's lock before a node's)
SELECT t.* FROM t WHERE (SELECT count(*) FROM n) >= 0

-- lock_task_facts_storing_logs --
-- lock_task_facts ($1, $2) with the output the group commit's nodes sent before their reports
-- stored first ($3–$9, as insert_logs takes them): in the same statement, the round trip of a
-- statement of their own saved on every group commit with output (a short task's last chunk comes
-- with its end). The chunks' foreign key checks (a share of each chunk's task's key, taken at the
-- statement's end, after `t` and `n` hold their locks) may be other tasks': no transaction holds a
-- task's key against them (claims take `FOR NO KEY UPDATE`; a task is deleted only long after it
-- ended, `prune_finished`), so they wait for nothing while this statement holds its nodes.
-- `told` is read by an outer join's preserved side, so it runs even when no task of $1 is found (the
-- chunks may be other tasks'): one row of nulls then, which the caller leaves out.
WITH {{stored_logs: $3::uuid[], $4::bigint[], $5::text[], $6::bigint[], $7::bigint[], $8::bytea[], $9::text[]}},
{{facts_locked: }}
SELECT t.* FROM (SELECT count(*) FROM told) z LEFT JOIN t ON true WHERE (SELECT count(*) FROM n) >= 0

-- _facts_locked --
-- The tasks of $1 locked in id order and read, then the nodes of those of them in $2 (lock_task_facts).
t AS (
    SELECT id, state, fencing_token, node_id, attempts, max_attempts, requeue_on_node_loss, timeout_seconds, cancel_reason
    FROM tasks WHERE id = ANY($1::uuid[])
    ORDER BY id
    FOR NO KEY UPDATE
), n AS (
    SELECT n.id FROM nodes n
    WHERE n.id IN (SELECT node_id FROM t WHERE t.id = ANY($2::uuid[]) AND t.node_id IS NOT NULL)
    ORDER BY n.id
    FOR NO KEY UPDATE
)

-- wake_dispatch --
-- Wake every dispatcher once this transaction commits (a commit whose own placements left room, or
-- a task they did not place). $1 is why: 'room' when only capacity was left free, '' otherwise (as
-- transition_tasks says it).
SELECT pg_notify('podium_dispatch', $1::text)

-- refill_room --
-- What a group commit of ends reads, in its own transaction, to place queued tasks on the room its
-- ends freed (`Store.transition_decided`'s `refill`): for each of the nodes $1 (their rows locked by
-- that transaction: what it reads stays true until it commits) that may be given work and whose
-- facts (all placement reads of a node but its reservations) have not changed since $3, the horizon
-- of the dispatcher's last read of the nodes (its snapshot of such a node is true but for the room):
-- its reservations, the GPU indexes its attempts hold and its capacity operations now; beside each,
-- the assignments not yet accepted by their node counted up to $2 (the window; 0: none). No row when
-- no such node may be given work (a node left out is placed on by the next pass, which reads it).
SELECT CASE WHEN $2::int > 0 THEN (SELECT count(*) FROM (SELECT 1 FROM tasks WHERE state = 'assigned' LIMIT $2::int) x)::int
            ELSE 0 END AS in_flight,
       c.id AS room_node, c.res_cpu_millis AS room_cpu_millis, c.res_memory_bytes AS room_memory_bytes,
       c.res_disk_bytes AS room_disk_bytes, c.res_gpus AS room_gpus, c.res_slots AS room_slots,
       ARRAY(SELECT g.gpu_index FROM gpu_claims g WHERE g.node_id = c.id) AS gpus_in_use,
       (SELECT count(*) FROM attempts a WHERE a.node_id = c.id AND a.finished_at IS NULL
          AND a.state IN ('assigned', 'provisioning'))::int AS operations
FROM nodes c
WHERE c.id = ANY($1::text[]) AND c.connected AND c.health = 'online' AND NOT c.draining AND c.revoked_at IS NULL
  AND c.facts_xid < $3::xid8
ORDER BY c.id

-- dispatch_facts --
-- What a dispatch pass reads before it claims, in one round trip: the snapshot horizon (every
-- transaction below it had ended when this statement began: node rows changed at or after it are read
-- again next pass), the assignments not yet accepted by their node counted up to $1 (the window), each
-- node's capacity operations now, and the nodes changed by any transaction at or after $2, the last
-- pass's horizon (connected or not, so a node that left is dropped from memory; all of them when $2 is
-- NULL). Of a node whose reservations alone changed (migration 0015) only those come (room_*, and the
-- GPU indexes its attempts hold); of any other, its whole row too (n.*). One row per changed node, the
-- horizon and the window's count repeated on each, the operations on the first row only; one row with
-- no node when none changed, or when the window is full ($1 > 0 and as many wait): that pass claims
-- nothing and reads the nodes next time. The horizon and the nodes come from one snapshot. $3 new
-- fencing tokens come on the first row too (`tokens`): a pass handed new tasks places them before its
-- transaction and sends their Assigns with these (`Store.dispatch`); a sequence is not transactional,
-- so a token drawn here and never used is only a number skipped.
WITH f AS MATERIALIZED (
    -- computed once (pulled up into the join, the window's count was run twice, once for the column
    -- and once for the join's condition: ~1.5 ms a pass at 1,600 assignments)
    SELECT pg_snapshot_xmin(pg_current_snapshot()) AS horizon,
           (SELECT count(*) FROM (SELECT 1 FROM tasks WHERE state = 'assigned' LIMIT $1) x)::int AS in_flight,
           COALESCE(o.nodes, '{}') AS operation_nodes, COALESCE(o.counts, '{}') AS operations
    FROM (SELECT array_agg(node_id) AS nodes, array_agg(n) AS counts FROM {{operations: attempts}}) o
), k AS (
    -- apart from f: a volatile call (nextval) in f would keep PostgreSQL from ever inlining it
    SELECT ARRAY(SELECT nextval('fencing_tokens') FROM generate_series(1, $3::int)) AS tokens
)
SELECT h.horizon, h.in_flight,
       -- The operations' arrays (an entry per node with an assignment or a provisioning in flight)
       -- once, on the first row, each a subquery run once. Joined with the nodes, they were carried
       -- beside every node's row through the join's hash: on 5,000 nodes with 4,000 assignments in
       -- flight, a read of every node (a server's first pass, then once a minute) spilled ~500 MB to
       -- temporary files and took ~490 ms (75 ms so), and a read of 3,126 changed nodes 45 ms (33).
       CASE WHEN row_number() OVER () = 1 THEN (SELECT operation_nodes FROM f) END AS operation_nodes,
       CASE WHEN row_number() OVER () = 1 THEN (SELECT operations FROM f) END AS operations,
       CASE WHEN row_number() OVER () = 1 THEN (SELECT tokens FROM k) END AS tokens,
       c.id AS room_node, c.res_cpu_millis AS room_cpu_millis, c.res_memory_bytes AS room_memory_bytes,
       c.res_disk_bytes AS room_disk_bytes, c.res_gpus AS room_gpus, c.res_slots AS room_slots,
       ARRAY(SELECT g.gpu_index FROM gpu_claims g WHERE g.node_id = c.id) AS gpus_in_use, n.*
FROM (SELECT horizon, in_flight FROM f) h
LEFT JOIN nodes c ON ($1 = 0 OR h.in_flight < $1) AND ($2::xid8 IS NULL OR c.changed_xid >= $2::xid8)
LEFT JOIN nodes n ON n.id = c.id AND ($2::xid8 IS NULL OR n.facts_xid >= $2::xid8)

-- task_attempts --
SELECT * FROM attempts WHERE task_id = $1 ORDER BY attempt

-- last_attempt_nodes --
-- Where each task's latest attempt ran (or runs): its node's id and name, also once the task has
-- ended and no longer holds a node. By the attempts' primary key, one row per task.
SELECT DISTINCT ON (a.task_id) a.task_id, a.node_id, n.name AS node_name
FROM attempts a LEFT JOIN nodes n ON n.id = a.node_id
WHERE a.task_id = ANY($1::uuid[])
ORDER BY a.task_id, a.attempt DESC

-- task_events --
SELECT * FROM task_events WHERE task_id = $1 ORDER BY id

-- list_tasks --
-- One page of tasks, newest first, after the cursor ($4, $5): the first page passes
-- ('infinity', the largest uuid), so the keyset condition is always an index condition.
SELECT * FROM tasks
WHERE (created_at, id) < ($4::timestamptz, $5::uuid)
  AND ($1::text IS NULL OR state = $1)
  AND ($2::text IS NULL OR node_id = $2)
  AND ($3::text IS NULL OR name = $3)
ORDER BY created_at DESC, id DESC
LIMIT $6

-- list_tasks_in_state --
-- The same page for one state, with no other filter: an index range scan of tasks_state_page.
SELECT * FROM tasks
WHERE state = $1 AND (created_at, id) < ($2::timestamptz, $3::uuid)
ORDER BY created_at DESC, id DESC
LIMIT $4

-- count_tasks_after --
-- How many tasks follow the cursor, counted up to $6: a bounded index scan, never the whole table.
SELECT count(*) FROM (
  SELECT 1 FROM tasks
  WHERE (created_at, id) < ($4::timestamptz, $5::uuid)
    AND ($1::text IS NULL OR state = $1)
    AND ($2::text IS NULL OR node_id = $2)
    AND ($3::text IS NULL OR name = $3)
  LIMIT $6
) x

-- tasks_by_prefix --
-- Tasks whose id lies in [$1, $2] (every uuid that starts with a typed prefix): a range scan of the
-- primary key, at most $3 of them.
SELECT id FROM tasks WHERE id BETWEEN $1 AND $2 ORDER BY id LIMIT $3

-- task_events_page --
SELECT * FROM task_events WHERE task_id = $1 AND id > $2 ORDER BY id LIMIT $3

-- insert_logs --
-- Log chunks from any number of nodes in one statement, each kept only if its node was given that
-- attempt. A chunk stored already (a node sends again what no server acknowledged) is left as it is.
-- Readers order by (fencing_token, seq), which the agent set; the join's row order (a hash join
-- emits them reversed) and so `id` say nothing about it.
-- Followers of those tasks' output are woken by NOTIFY podium_logs (delivered at commit), its payload
-- the ids of the tasks given new chunks, each once, comma-separated: one NOTIFY for the statement,
-- not one per chunk, and one more per further 200 tasks (200 ids are 7,399 bytes; a payload must
-- stay below 8,000). A chunk sent again and left as it was wakes no one.
WITH {{stored_logs: $1::uuid[], $2::bigint[], $3::text[], $4::bigint[], $5::bigint[], $6::bytea[], $7::text[]}}
SELECT count(*) FROM told

-- _stored_logs --
-- insert_logs' chunks (task, token, stream, seq, byte offset, data, node: the arrays __ROWS__), stored
-- and told (`told`, which the including statement must read to run).
stored AS (
    INSERT INTO log_chunks (task_id, fencing_token, stream, seq, byte_offset, data)
    SELECT d.task_id, d.token, d.stream, d.seq, d.byte_offset, d.data
    FROM unnest(__ROWS__) AS d(task_id, token, stream, seq, byte_offset, data, node_id)
    JOIN attempts a ON a.task_id = d.task_id AND a.fencing_token = d.token AND a.node_id = d.node_id
    ON CONFLICT DO NOTHING
    RETURNING task_id
), written AS (
    SELECT task_id, (row_number() OVER () - 1) / 200 AS batch FROM (SELECT DISTINCT task_id FROM stored) t
), told AS (
    SELECT pg_notify('podium_logs', string_agg(task_id::text, ',')) FROM written GROUP BY batch
)

-- read_logs --
-- A task's output in the order it was written: attempt after attempt, then the agent's seq (both
-- streams, in the order the agent read them), from just after the position ($2, $3, $4); stream ($5)
-- and attempt ($6) narrow it, and chunks that end at or before byte $7 of their stream are skipped.
SELECT l.id, l.fencing_token, a.attempt, l.stream, l.seq, l.byte_offset, l.data, l.at
FROM log_chunks l JOIN attempts a ON a.task_id = l.task_id AND a.fencing_token = l.fencing_token
WHERE l.task_id = $1
  AND (l.fencing_token, l.seq, l.stream) > ($2::bigint, $3::bigint, $4::text)
  AND ($5::text IS NULL OR l.stream = $5)
  AND ($6::int IS NULL OR a.attempt = $6)
  AND l.byte_offset + length(l.data) > $7
ORDER BY l.fencing_token, l.seq, l.stream
LIMIT $8

-- log_position --
-- Where chunk `id` of a task is in its output: what `after=<id>` (the first API's cursor) resumes from.
SELECT fencing_token, seq, stream FROM log_chunks WHERE task_id = $1 AND id = $2

-- watch_overdue_accept --
SELECT id, state, fencing_token, attempts, max_attempts FROM tasks
WHERE state = 'assigned' AND accept_deadline < now()
LIMIT $1

-- watch_timeouts --
-- Running tasks past their timeout, read by when it is up (migration 0017's index): only those.
SELECT id, state, fencing_token FROM tasks
WHERE state = 'running' AND timeout_seconds IS NOT NULL AND podium_timeout_at(started_at, timeout_seconds) < now()
LIMIT $1

-- watch_cancel_grace --
SELECT id, state, fencing_token, cancel_reason FROM tasks
WHERE state = 'cancelling' AND cancel_requested_at < now() - make_interval(secs => $1)
LIMIT $2

-- watch_lost --
-- Tasks whose node is offline, whose lease has run out, or that claim to be on a node with no lease
-- of any kind. Each of the three is found through its own index (migration 0017): the offline nodes,
-- then their live tasks; the leases run out; the rows with no lease. Reading every live task to find
-- them cost a sweep time in proportion to all the work running, every second. The rows found are
-- then read by their key, one at a time (OFFSET 0 keeps the planner from joining them any other way).
SELECT t.id, t.state, t.fencing_token, t.attempts, t.max_attempts, t.requeue_on_node_loss,
       CASE WHEN t.node_id IS NULL OR t.fencing_token IS NULL THEN 'no_lease'
            -- a removed node is offline too; the sweep may get to its tasks before the removal's
            -- own pass does, and must give the same, true reason
            WHEN n.revoked_at IS NOT NULL THEN 'revoked'
            WHEN n.health = 'offline' THEN 'offline'
            ELSE 'lease' END AS why
FROM unnest(ARRAY(
        (SELECT l.id FROM nodes o JOIN tasks l ON l.node_id = o.id
         WHERE o.health = 'offline' AND l.state IN ('assigned', 'provisioning', 'running') LIMIT $1)
        UNION
        (SELECT id FROM tasks
         WHERE state IN ('assigned', 'provisioning', 'running') AND lease_expires_at IS NOT NULL
           AND lease_expires_at < now() LIMIT $1)
        UNION
        (SELECT id FROM tasks
         WHERE state IN ('assigned', 'provisioning', 'running') AND (node_id IS NULL OR fencing_token IS NULL)
         LIMIT $1))) AS due(id)
CROSS JOIN LATERAL (
    SELECT id, state, fencing_token, attempts, max_attempts, requeue_on_node_loss, node_id, lease_expires_at
    FROM tasks WHERE tasks.id = due.id OFFSET 0) t
LEFT JOIN nodes n ON n.id = t.node_id
-- the same question again on the row read here: the answer is the row's, whatever the lookups saw
WHERE t.state IN ('assigned', 'provisioning', 'running')
  AND (t.node_id IS NULL OR t.fencing_token IS NULL OR n.health = 'offline' OR t.lease_expires_at < now())
LIMIT $1

-- prune_finished --
-- (never a task whose sandbox still holds capacity: its attempt is what releases it, once proven gone)
-- Its attempts and output go by their keys' cascades; its events have no key (migration 0016) and go
-- here, in the same statement. The count of tasks deleted.
WITH gone AS (
    DELETE FROM tasks WHERE id IN (
        SELECT id FROM tasks t WHERE t.finished_at < now() - make_interval(secs => $1)
          AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.task_id = t.id AND NOT a.released)
        LIMIT $2)
    RETURNING id
), events AS (
    DELETE FROM task_events e USING gone WHERE e.task_id = gone.id
)
SELECT count(*) FROM gone

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

-- ---- sandboxes: resolved images and release proofs ------------------------------------------------

-- claim_unresolved --
-- The resolver loop's claim: queued container tasks whose image has no digest yet and whose next try
-- is due, in the order dispatch claims. The claim is a short lease (resolve_after moves ahead by $2
-- seconds), so replicas resolving at once take disjoint tasks and one that dies mid-way leaves its
-- tasks to the next at the lease's end; no row lock is held across the call to the registry.
WITH c AS (
    SELECT id FROM tasks
    WHERE state = 'queued' AND image IS NOT NULL AND image_digest IS NULL
      AND (resolve_after IS NULL OR resolve_after <= now())
    ORDER BY priority DESC, created_at, id
    LIMIT $1
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE tasks t SET resolve_after = now() + make_interval(secs => $2)
FROM c WHERE t.id = c.id
RETURNING t.id, t.image, t.resolve_tries

-- set_resolved --
-- Pin each task's image to the digest its tag resolved to: every attempt from now on runs exactly
-- that. Only a task still queued and unresolved is written; the dispatcher is woken once.
WITH r AS (
    UPDATE tasks t SET image_digest = d.digest, resolved_at = now(), resolve_after = NULL,
        reason = $3, reason_detail = NULL, updated_at = now()
    FROM unnest($1::uuid[], $2::text[]) AS d(id, digest)
    -- `IS TRUE` for the reason assign_tasks gives: each task by its key, not the queue read whole
    WHERE t.id = d.id AND (t.state = 'queued') IS TRUE AND t.image_digest IS NULL
    RETURNING t.id
), n AS (
    SELECT pg_notify('podium_dispatch', '') FROM r LIMIT 1
)
SELECT r.id, (SELECT count(*) FROM n) AS notified FROM r

-- set_unresolved --
-- The image's registry could not be reached: the task stays queued with the reason and the
-- registry's (or the network's) words beside it, and is tried again in `backoff` seconds.
UPDATE tasks t SET reason = $4, reason_detail = d.detail, resolve_tries = t.resolve_tries + 1,
    resolve_after = now() + make_interval(secs => d.backoff), updated_at = now()
FROM unnest($1::uuid[], $2::text[], $3::float8[]) AS d(id, detail, backoff)
WHERE t.id = d.id AND (t.state = 'queued') IS TRUE AND t.image_digest IS NULL  -- as set_resolved

-- release_proofs --
-- Nodes' release proofs, any number in one statement. Each is recorded on the attempt it names —
-- that task and fencing token, on the node that sent it, a container attempt with no proof yet and,
-- if the attempt reported one, the same backend reference — and frees the attempt's capacity in
-- the same statement if its end is already recorded (else its end will). A repeat, a proof that
-- comes after the node-loss policy released the attempt, another node's attempt or a made-up token
-- matches no row and changes nothing. The caller locks the tasks, then the nodes, in id order first:
-- the order every other change takes them in.
WITH d AS (
    SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::float8[])
        AS d(task_id, token, node_id, backend_ref, released_at)
), proved AS (
    UPDATE attempts a SET
        release_proof = jsonb_build_object('by', 'node', 'backend_ref', d.backend_ref,
                                           'released_at', CASE WHEN d.released_at > 0 THEN to_timestamp(d.released_at) END),
        released = a.finished_at IS NOT NULL,
        released_at = CASE WHEN a.finished_at IS NOT NULL THEN now() END
    FROM d
    WHERE a.task_id = d.task_id AND a.fencing_token = d.token AND a.node_id = d.node_id
      AND a.backend_kind = 'container' AND a.release_proof IS NULL AND NOT a.released
      AND (a.backend_ref IS NULL OR a.backend_ref = d.backend_ref)
    RETURNING a.task_id, a.fencing_token, a.node_id, a.cpu_millis, a.memory_bytes, a.disk_bytes, a.gpus, a.released
), unclaimed AS (
    DELETE FROM gpu_claims g USING proved p WHERE g.fencing_token = p.fencing_token AND p.gpus > 0 AND p.released
), {{freed: proved WHERE proved.released}}, woke AS (
    -- capacity freed, nothing queued: 'room' (see transition_tasks)
    SELECT count(pg_notify('podium_dispatch', 'room')) AS n FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM freed)) z
)
SELECT p.task_id, p.fencing_token, p.released, (SELECT n FROM woke) AS woke FROM proved p

-- release_abandoned --
-- The node-loss policy gives up on a node (offline, or removed from the fleet): the ended container
-- attempts still waiting there for a release proof are released now, with a proof saying why. Rows
-- are locked without waiting (the next sweep takes what another transaction holds), so the watchdog
-- never waits in a cycle with reports, proofs or placement.
WITH c AS (
    SELECT a.fencing_token, CASE WHEN n.revoked_at IS NOT NULL THEN $2 ELSE $3 END AS reason
    FROM attempts a JOIN nodes n ON n.id = a.node_id
    WHERE a.finished_at IS NOT NULL AND NOT a.released AND (n.health = 'offline' OR n.revoked_at IS NOT NULL)
    ORDER BY a.node_id, a.fencing_token
    LIMIT $1
    FOR NO KEY UPDATE OF a, n SKIP LOCKED
), rel AS (
    UPDATE attempts a SET released = true, released_at = now(),
        release_proof = jsonb_build_object('by', 'server', 'reason', c.reason)
    FROM c
    WHERE a.fencing_token = c.fencing_token AND a.finished_at IS NOT NULL AND NOT a.released
    RETURNING a.task_id, a.fencing_token, a.node_id, a.cpu_millis, a.memory_bytes, a.disk_bytes, a.gpus
), unclaimed AS (
    DELETE FROM gpu_claims g USING rel WHERE g.fencing_token = rel.fencing_token AND rel.gpus > 0
), {{freed: rel}}
SELECT rel.task_id, rel.fencing_token, rel.node_id, (SELECT count(*) FROM freed) AS nodes FROM rel

-- nodes_releasing --
-- Per node, the capacity of ended attempts still waiting for their release proof.
SELECT node_id, sum(cpu_millis)::bigint AS cpu_millis, sum(memory_bytes)::bigint AS memory_bytes,
       sum(disk_bytes)::bigint AS disk_bytes, sum(gpus)::int AS gpus, count(*)::int AS slots
FROM attempts
WHERE node_id = ANY($1::text[]) AND finished_at IS NOT NULL AND NOT released
GROUP BY node_id

-- _freed --
-- A fragment, not a query: `{{freed: <rows>}}` in a query above is this CTE, freeing on their nodes
-- the capacity of <rows> (attempts: node_id, cpu_millis, memory_bytes, disk_bytes, gpus), one
-- UPDATE row per node whatever number of its attempts are freed. Written once: every way an
-- attempt's capacity comes back (its end, its release proof, the node-loss policy giving up on its
-- node) frees exactly this.
freed AS (
    UPDATE nodes n SET
        res_cpu_millis = n.res_cpu_millis - f.cpu,
        res_memory_bytes = n.res_memory_bytes - f.mem,
        res_disk_bytes = n.res_disk_bytes - f.disk,
        res_gpus = n.res_gpus - f.gpus,
        res_slots = n.res_slots - f.slots
    FROM (SELECT node_id, sum(cpu_millis) AS cpu, sum(memory_bytes) AS mem, sum(disk_bytes) AS disk,
                 sum(gpus) AS gpus, count(*) AS slots
          FROM __ROWS__ GROUP BY node_id) f
    WHERE n.id = f.node_id
    RETURNING n.id
)

-- _stored_tasks --
-- insert_tasks' CTEs (`t`: the tasks stored), for insert_tasks and insert_tasks_claiming: the rows
-- (__1__), the reason a queued task waits for (__2__), who submitted them (__3__), whether to wake
-- a dispatcher (__4__). `r` (the resolver's NOTIFY) is sent only if the including statement reads it.
d AS (
    SELECT (v->>0)::uuid AS id, v->>1 AS name, v->>2 AS spec, (v->>3)::int AS priority, (v->>4)::bigint AS cpu,
           (v->>5)::bigint AS mem, (v->>6)::bigint AS disk, (v->>7)::int AS gpus, (v->>8)::float8 AS timeout,
           (v->>9)::int AS max_attempts, (v->>10)::boolean AS requeue, v->>11 AS ikey, v->>12 AS spec_name,
           (v->>13)::int AS spec_revision
    FROM jsonb_array_elements(__1__::jsonb) AS r(v)
), t AS (
    INSERT INTO tasks (id, name, spec, state, reason, priority, cpu_millis, memory_bytes, disk_bytes, gpus,
                       timeout_seconds, max_attempts, requeue_on_node_loss, idempotency_key, submitted_by,
                       spec_name, spec_revision)
    SELECT id, name, spec::jsonb, 'queued', __2__, priority, cpu, mem, disk, gpus, timeout, max_attempts, requeue, ikey, __3__,
           spec_name, spec_revision
    FROM d
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING *
), e AS (
    INSERT INTO task_events (task_id, from_state, to_state, reason, actor)
    SELECT id, NULL, 'queued', NULL, __3__ FROM t
), a AS (
    INSERT INTO audit_log (actor, action, target, detail)
    SELECT __3__, 'task.submit', id::text, jsonb_build_object('name', name) FROM t
), n AS (
    SELECT pg_notify('podium_dispatch', '') FROM t WHERE __4__::bool LIMIT 1
), r AS (
    SELECT pg_notify('podium_resolve', '') FROM t WHERE t.image IS NOT NULL AND t.image_digest IS NULL LIMIT 1
)

-- _claimable --
-- claim_queued's claim, `c`: up to __1__ queued tasks in claim order, none of __2__, locked.
c AS MATERIALIZED (
    SELECT t.id, t.spec::text AS spec, t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, t.reason, t.image_digest,
           t.attempts,
           ARRAY(SELECT DISTINCT a.node_id FROM attempts a
                 WHERE a.task_id = t.id AND a.state IN ('revoked', 'lost', 'failed')) AS avoid,
           t.priority, t.created_at
    FROM tasks t
    WHERE t.state = 'queued' AND (t.image IS NULL OR t.image_digest IS NOT NULL)
      AND NOT (t.id = ANY(__2__::uuid[]))
    ORDER BY t.priority DESC, t.created_at, t.id
    LIMIT __1__
    -- NO KEY: a claimed task's key never changes, and a stronger lock would hold a foreign key's
    -- check (a log chunk of the task inserted by a group commit that holds nodes this pass then
    -- locks: a deadlock, PostgreSQL's deadlock_timeout later)
    FOR NO KEY UPDATE OF t SKIP LOCKED
)

-- _claim_locks --
-- claim_queued's `lk`: the nodes __3__ locked, in id order, when the claim __1__ came up short of
-- __2__ with none but the tasks __4__.
lk AS (
    SELECT n.id FROM nodes n
    WHERE n.id = ANY(__3__::text[]) AND (SELECT count(*) FROM __1__) < __2__
      AND NOT EXISTS (SELECT 1 FROM __1__ WHERE NOT (__1__.id = ANY(__4__::uuid[])))
    ORDER BY n.id
    FOR NO KEY UPDATE
)

-- _claimed_rows --
-- claim_queued's answer, in no order: the claimed rows of __1__, and, when they are fewer than __2__,
-- the marker row if a queued task (none of __3__ nor of `c`) was passed over because another
-- transaction holds it.
SELECT id, spec, cpu_millis, memory_bytes, disk_bytes, gpus, reason, image_digest, attempts, avoid,
       false AS held, priority, created_at, (SELECT count(*) FROM lk) AS locked
FROM __1__
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, true, NULL, NULL, (SELECT count(*) FROM lk)
-- (CASE, not AND: PostgreSQL orders an AND's terms by their cost, and would look at the queue for a
-- claim that filled its limit too)
WHERE CASE WHEN (SELECT count(*) FROM __1__) < __2__ THEN EXISTS (
    SELECT 1 FROM tasks q
    WHERE q.state = 'queued' AND (q.image IS NULL OR q.image_digest IS NOT NULL)
      AND NOT (q.id = ANY(__3__::uuid[])) AND q.id NOT IN (SELECT id FROM c)) ELSE false END
