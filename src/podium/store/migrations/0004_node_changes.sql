-- Placement keeps the nodes it read in memory between ticks and reads again only the rows that
-- changed since. `changed_xid` is the transaction that last changed anything placement reads; a
-- heartbeat that changes nothing of it leaves it alone. Readers use the xmin of the snapshot of their
-- previous read as the horizon: every transaction below it had ended before that read, so a change
-- committed late by an older transaction is never missed (a sequence or a timestamp would be).
ALTER TABLE nodes ADD COLUMN changed_xid xid8;
UPDATE nodes SET changed_xid = pg_current_xact_id();
ALTER TABLE nodes ALTER COLUMN changed_xid SET NOT NULL;

CREATE FUNCTION podium_node_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR
       ROW(NEW.res_cpu_millis, NEW.res_memory_bytes, NEW.res_disk_bytes, NEW.res_gpus, NEW.res_slots,
           NEW.alloc_cpu_millis, NEW.alloc_memory_bytes, NEW.alloc_disk_bytes, NEW.alloc_gpus, NEW.alloc_slots,
           NEW.health, NEW.draining, NEW.connected, NEW.revoked_at, NEW.labels, NEW.pool, NEW.arch, NEW.name,
           NEW.capabilities, NEW.backends, NEW.artifacts, NEW.protocol_min, NEW.protocol_max, NEW.gpu_indexes)
       IS DISTINCT FROM
       ROW(OLD.res_cpu_millis, OLD.res_memory_bytes, OLD.res_disk_bytes, OLD.res_gpus, OLD.res_slots,
           OLD.alloc_cpu_millis, OLD.alloc_memory_bytes, OLD.alloc_disk_bytes, OLD.alloc_gpus, OLD.alloc_slots,
           OLD.health, OLD.draining, OLD.connected, OLD.revoked_at, OLD.labels, OLD.pool, OLD.arch, OLD.name,
           OLD.capabilities, OLD.backends, OLD.artifacts, OLD.protocol_min, OLD.protocol_max, OLD.gpu_indexes)
    THEN
        NEW.changed_xid := pg_current_xact_id();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_changed BEFORE INSERT OR UPDATE ON nodes
    FOR EACH ROW EXECUTE FUNCTION podium_node_changed();
