-- A dispatch pass reads again the node rows changed since its last read (0004: `changed_xid`). On a
-- busy fleet nearly every node changed between two passes, but only its reservations did (a placement
-- reserves, an end frees), and every such row was read and decoded whole: ~40 columns, its labels and
-- materializations, to learn five numbers (issue 17: a fifth of the server's CPU in the lifecycle run).
--
-- `facts_xid` is the transaction that last changed anything placement reads of a node other than its
-- reservations (the res_* columns, and the GPU indexes its attempts hold, which move with res_gpus).
-- A pass reads a node whose facts_xid is past its horizon whole, and of every other changed node only
-- what its reservations are now. `changed_xid` still moves with everything, so a server older than
-- this migration, which reads by it alone, reads exactly what it always read.
ALTER TABLE nodes ADD COLUMN facts_xid xid8;
UPDATE nodes SET facts_xid = changed_xid;
ALTER TABLE nodes ALTER COLUMN facts_xid SET NOT NULL;

-- Every column placement reads but the reservations: 0004's list, 0009's egress contexts and 0012's
-- max_operations. Its own trigger, like theirs, so that migrations extending it compose.
CREATE FUNCTION podium_node_facts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR
       ROW(NEW.alloc_cpu_millis, NEW.alloc_memory_bytes, NEW.alloc_disk_bytes, NEW.alloc_gpus, NEW.alloc_slots,
           NEW.health, NEW.draining, NEW.connected, NEW.revoked_at, NEW.labels, NEW.pool, NEW.arch, NEW.name,
           NEW.capabilities, NEW.backends, NEW.artifacts, NEW.protocol_min, NEW.protocol_max, NEW.gpu_indexes,
           NEW.egress_contexts, NEW.max_operations)
       IS DISTINCT FROM
       ROW(OLD.alloc_cpu_millis, OLD.alloc_memory_bytes, OLD.alloc_disk_bytes, OLD.alloc_gpus, OLD.alloc_slots,
           OLD.health, OLD.draining, OLD.connected, OLD.revoked_at, OLD.labels, OLD.pool, OLD.arch, OLD.name,
           OLD.capabilities, OLD.backends, OLD.artifacts, OLD.protocol_min, OLD.protocol_max, OLD.gpu_indexes,
           OLD.egress_contexts, OLD.max_operations)
    THEN
        NEW.facts_xid := pg_current_xact_id();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_facts_changed BEFORE INSERT OR UPDATE ON nodes
    FOR EACH ROW EXECUTE FUNCTION podium_node_facts_changed();
