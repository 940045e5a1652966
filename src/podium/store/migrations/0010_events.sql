-- The event stream (GET /v1/events) and the web UI's sessions.
--
-- Event order. task_events.id comes from a sequence, so ids are not handed out in commit order: an
-- event with a lower id can commit after one with a higher id, and a reader resuming "after id N"
-- would skip it. Every event row therefore also records the transaction that wrote it (`txid`), and
-- the stream delivers an event only once its transaction is below the reading snapshot's xmin (every
-- transaction there has ended), in (txid, id) order: the same horizon placement uses for node rows
-- (0004). Anything committed later sorts after everything already delivered, so nothing is skipped
-- and nothing is sent twice. Rows older than this migration keep txid 0 and sort first, by id.
ALTER TABLE task_events ADD COLUMN txid xid8 NOT NULL DEFAULT '0';
ALTER TABLE task_events ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
CREATE INDEX task_events_stream ON task_events (txid, id);

-- Node changes an operator watches (health, connected, drain, labels, removal), one row per change,
-- written by a trigger wherever the row changes so no code path can forget it. The ids come from
-- task_events' own sequence: one id space for the whole stream, so an event id names one event.
CREATE TABLE node_states (
    id                  bigint PRIMARY KEY DEFAULT nextval('task_events_id_seq'),
    txid                xid8 NOT NULL DEFAULT pg_current_xact_id(),
    node_id             text NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    at                  timestamptz NOT NULL DEFAULT now(),
    health              text NOT NULL,
    connected           boolean NOT NULL,
    draining            boolean NOT NULL,
    revoked             boolean NOT NULL,
    labels              jsonb NOT NULL
);
CREATE INDEX node_states_stream ON node_states (txid, id);
CREATE INDEX node_states_node ON node_states (node_id, id);

CREATE FUNCTION podium_node_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO node_states (node_id, health, connected, draining, revoked, labels)
    VALUES (NEW.id, NEW.health, NEW.connected, NEW.draining, NEW.revoked_at IS NOT NULL, NEW.labels);
    RETURN NULL;
END
$$;

CREATE TRIGGER nodes_event_insert AFTER INSERT ON nodes
    FOR EACH ROW EXECUTE FUNCTION podium_node_state();
-- a heartbeat changes none of these, so it writes no event
CREATE TRIGGER nodes_event_update AFTER UPDATE ON nodes
    FOR EACH ROW WHEN (ROW(NEW.health, NEW.connected, NEW.draining, NEW.revoked_at IS NULL, NEW.labels)
                       IS DISTINCT FROM ROW(OLD.health, OLD.connected, OLD.draining, OLD.revoked_at IS NULL, OLD.labels))
    EXECUTE FUNCTION podium_node_state();

-- One NOTIFY per statement that wrote events (delivered at commit, merged within a transaction):
-- the server's one listener wakes and reads what is new for all its stream clients at once.
CREATE FUNCTION podium_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM pg_notify('podium_events', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER task_events_notify AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION podium_events_notify();
CREATE TRIGGER node_states_notify AFTER INSERT ON node_states
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION podium_events_notify();

-- The web UI's sign-in sessions: a browser holds a random session secret in an HttpOnly cookie; the
-- database holds only its hash, the token it signed in with (revoking the token ends the session)
-- and the session's CSRF token, which every state-changing form must carry.
CREATE TABLE ui_sessions (
    id                  bytea PRIMARY KEY,               -- sha256 of the cookie's secret
    token_id            text NOT NULL REFERENCES api_tokens(id) ON DELETE CASCADE,
    csrf                text NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    expires_at          timestamptz NOT NULL
);
CREATE INDEX ui_sessions_expires ON ui_sessions (expires_at);

-- The UI's task list pages newest first by (created_at, id): 0007's tasks_page serves it.
