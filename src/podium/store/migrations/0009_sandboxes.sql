-- Sandboxes (seed 001): failure classes, release proofs, egress contexts and resolved images.

-- Why an attempt ended, as a class beside its reason, with the node's (or engine's) own words; the
-- backend and its reference to what ran; and the proof that its sandbox is gone. A container
-- attempt keeps its capacity after its end until a proof is recorded (`released` stays false
-- meanwhile: the node shows it as "releasing"); a process attempt is released with its end.
ALTER TABLE attempts
    ADD COLUMN failure_class    text,
    ADD COLUMN failure_detail   text,
    ADD COLUMN backend_kind     text NOT NULL DEFAULT 'process',
    ADD COLUMN backend_ref      text,                   -- process group id, container id (from RUNNING)
    ADD COLUMN release_proof    jsonb,                  -- {"by": "node", "backend_ref", "released_at"} or {"by": "server", "reason"}
    ADD COLUMN released_at      timestamptz;            -- when its capacity was freed (database clock)

-- The capacity of ended attempts that still wait for their proof, per node.
CREATE INDEX attempts_releasing ON attempts (node_id) WHERE finished_at IS NOT NULL AND NOT released;

-- The task: the image it runs (copied out of the spec so no hot query parses JSON), the digest its
-- tag was resolved to once (every attempt runs that digest), when the next resolution may be tried,
-- and the words beside the reason (a registry's, an engine's).
ALTER TABLE tasks
    ADD COLUMN image            text GENERATED ALWAYS AS (spec->>'image') STORED,
    ADD COLUMN image_digest     text,
    ADD COLUMN resolved_at      timestamptz,
    ADD COLUMN resolve_tries    int NOT NULL DEFAULT 0,
    ADD COLUMN resolve_after    timestamptz,
    ADD COLUMN reason_detail    text;

-- What the resolver loop looks at: queued container tasks whose image has no digest yet.
CREATE INDEX tasks_unresolved ON tasks (priority DESC, created_at, id)
    WHERE state = 'queued' AND image IS NOT NULL AND image_digest IS NULL;

-- The history says what class each end was, and the words beside its reason.
ALTER TABLE task_events
    ADD COLUMN failure_class    text,
    ADD COLUMN detail           text;

-- What a node's sandboxes can give: its network egress contexts, and whether CPU and memory are
-- enforced as limits.
ALTER TABLE nodes
    ADD COLUMN egress_contexts  text[] NOT NULL DEFAULT '{open}',
    ADD COLUMN enforces_limits  boolean NOT NULL DEFAULT false;

-- Placement reads egress_contexts: a change to it must move changed_xid like every other field
-- placement reads. A trigger of its own rather than a new podium_node_changed(), so this migration
-- and any other that extends the node trigger compose instead of replacing each other.
CREATE FUNCTION podium_node_egress_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.egress_contexts IS DISTINCT FROM OLD.egress_contexts THEN
        NEW.changed_xid := pg_current_xact_id();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_egress_changed BEFORE UPDATE ON nodes
    FOR EACH ROW EXECUTE FUNCTION podium_node_egress_changed();
