-- SecondBox's contract (seed 001): drain phases and the assignment revision.
--
-- Drain phases. `draining` stays the one switch placement reads; a drain may carry a deadline past
-- which the watchdog applies the node-loss policy to what still runs there. The phase an operator
-- sees is derived, never stored, so it can never disagree with the tasks it summarises:
--   active   — not draining;
--   draining — draining, and some task still holds the node (assigned, provisioning, running, cancelling);
--   drained  — draining, and nothing holds it any more: safe to power off.
ALTER TABLE nodes ADD COLUMN drain_deadline timestamptz;

CREATE FUNCTION podium_drain_phase(node text, draining boolean) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN NOT draining THEN 'active'
        WHEN EXISTS (SELECT 1 FROM tasks t WHERE t.node_id = node
                     AND t.state IN ('assigned', 'provisioning', 'running', 'cancelling')) THEN 'draining'
        ELSE 'drained' END
$$;

-- Assignment revision. Every statement that changes a task's assignment (its state, its node, its
-- attempt, a cancel) adds one in the same statement, so a client holding revision N can make its
-- write conditional on nothing having changed since (If-Match).
ALTER TABLE tasks ADD COLUMN revision bigint NOT NULL DEFAULT 1;

-- A node's revision counts the operator's changes to it (labels, drain), so `If-Match` on a label
-- change refuses to overwrite labels someone else changed since they were read. Heartbeats and
-- Hellos do not touch it: they change the node many times a minute and say nothing an operator
-- decided.
ALTER TABLE nodes ADD COLUMN revision bigint NOT NULL DEFAULT 1;
