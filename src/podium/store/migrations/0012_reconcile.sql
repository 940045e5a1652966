-- The rest of SecondBox's contract (seed 001): reconcile claims, what an assignment was decided on,
-- capacity operations and materialization snapshots.

-- Reconcile claims. Every live attempt is rechecked against what its node last said, by whichever
-- replica claims it first: a claim names its owner and expires, so a replica that dies holding
-- claims loses them at the expiry and another one takes them over. The last check's time, replica
-- and one-sentence result are kept for `podium show`.
ALTER TABLE attempts
    ADD COLUMN reconcile_owner             text,
    ADD COLUMN reconcile_claim_expires_at  timestamptz,
    ADD COLUMN next_reconcile_at           timestamptz,
    ADD COLUMN last_reconciled_at          timestamptz,
    ADD COLUMN last_reconciled_by          text,
    ADD COLUMN last_reconcile_result       text;

-- Attempts assigned before this migration are due at once.
UPDATE attempts SET next_reconcile_at = now() WHERE finished_at IS NULL;

-- What the reconcile loop claims from: live attempts, by when they are due.
CREATE INDEX attempts_reconcile_due ON attempts (next_reconcile_at, fencing_token) WHERE finished_at IS NULL;

-- What an assignment was decided on (seed DurableAssignment): the node as placement saw it (pool,
-- arch, labels, capabilities, backends, egress contexts, its runtime per backend), and the retry
-- budget at the time: this is retry `retry_count` of at most `retry_limit` (max_attempts - 1).
-- The operation deadline is the attempt's accept_deadline; backend_kind and backend_ref exist (0009).
ALTER TABLE attempts
    ADD COLUMN capability_snapshot  jsonb,
    ADD COLUMN retry_count          int NOT NULL DEFAULT 0,
    ADD COLUMN retry_limit          int NOT NULL DEFAULT 0;

-- What a node's last Hello said: the attempts it still held (their fencing tokens), so the
-- reconcile loop can check an attempt against it long after the Hello was handled.
ALTER TABLE nodes ADD COLUMN hello_tokens bigint[] NOT NULL DEFAULT '{}';

-- Capacity operations (seed Capacity.Operations): how many provisioning operations (pulls, creates)
-- a node runs at once. An attempt is one from its assignment until it runs (or ends): counted from
-- the attempts table under the node's row lock when placing, so no counter can drift.
ALTER TABLE nodes ADD COLUMN max_operations int NOT NULL DEFAULT 4 CHECK (max_operations >= 1);
CREATE INDEX attempts_operations ON attempts (node_id) WHERE finished_at IS NULL AND state IN ('assigned', 'provisioning');

-- Materialization snapshots (seed MaterializationSnapshot): per backend, its kind, architecture,
-- runtime digest, toolchain digest and artifact digest, as the node's last Hello said.
ALTER TABLE nodes ADD COLUMN materializations jsonb NOT NULL DEFAULT '[]';

-- Placement reads max_operations: a change must move changed_xid like every field placement reads
-- (a trigger of its own, so migrations extending the node trigger compose; see 0009).
CREATE FUNCTION podium_node_operations_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.max_operations IS DISTINCT FROM OLD.max_operations THEN
        NEW.changed_xid := pg_current_xact_id();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_operations_changed BEFORE UPDATE ON nodes
    FOR EACH ROW EXECUTE FUNCTION podium_node_operations_changed();

-- A named spec's revision (a profile revision) never changes once stored: a task pinned to it keeps
-- exactly that content on every attempt (tasks.spec is its copy). A change is a new revision.
CREATE FUNCTION podium_named_spec_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'revision % of spec % cannot be changed: store a new revision instead', OLD.revision, OLD.name
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER named_specs_immutable BEFORE UPDATE ON named_specs
    FOR EACH ROW EXECUTE FUNCTION podium_named_spec_immutable();
