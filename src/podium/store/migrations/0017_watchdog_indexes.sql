-- The watchdog's sweep (every second) looked at every live task to find the few it must act on: the
-- tasks on an offline node, with a lease run out or with no lease at all (`watch_lost`), running past
-- their timeout (`watch_timeouts`), on a node whose drain or handover deadline passed (`drain_overdue`,
-- `handover_due`). With 112,000 tasks running on 5,000 nodes (issue 17's placement run) one sweep took
-- ~400 ms of the database's CPU and grew with every task placed, though nothing was due.
--
-- Each question now has an index holding only the rows that can answer it, so a sweep reads what is
-- due and nothing else. A task's row is never updated HOT (its state is indexed), so these cost one
-- entry for each version of a row their predicate admits: a task's versions while it holds a lease
-- (assigned, provisioning, and running under a timeout), running under a timeout, or holding no lease
-- by mistake. The node indexes admit a node only while it is offline, draining or handing over; a
-- heartbeat changes none of those columns, so it stays a HOT update.
CREATE INDEX tasks_lease_due ON tasks (lease_expires_at)
    WHERE state IN ('assigned', 'provisioning', 'running') AND lease_expires_at IS NOT NULL;
CREATE INDEX tasks_unleased ON tasks (id)
    WHERE state IN ('assigned', 'provisioning', 'running') AND (node_id IS NULL OR fencing_token IS NULL);
-- When a running task's timeout is up. IMMUTABLE so that it can be indexed: a timestamp plus a number
-- of seconds is the same instant in every time zone (PostgreSQL marks `+ interval` only STABLE for the
-- days and months an interval may hold, which make_interval(secs => …) never does).
CREATE FUNCTION podium_timeout_at(started timestamptz, seconds double precision) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE RETURN started + make_interval(secs => seconds);
CREATE INDEX tasks_timing_out ON tasks (podium_timeout_at(started_at, timeout_seconds))
    WHERE state = 'running' AND timeout_seconds IS NOT NULL;
CREATE INDEX nodes_offline ON nodes (id) WHERE health = 'offline';
CREATE INDEX nodes_draining ON nodes (drain_deadline) WHERE draining;
CREATE INDEX nodes_handing_over ON nodes (handover_until) WHERE cardinality(handover_tokens) > 0;
