-- One live agent per node identity. Every agent process has an instance id; the node row names the
-- current one. A Hello from another instance supersedes it: the old instance is told to stop, and
-- the attempts the new one does not report stay the node's until the old instance has certainly
-- stopped them itself (its fence deadline, `handover_until`), never before.
ALTER TABLE nodes ADD COLUMN instance_id text;
ALTER TABLE nodes ADD COLUMN instance_peer text;
ALTER TABLE nodes ADD COLUMN handover_until timestamptz;
-- attempts a new instance did not report while the old one may still run them: the node-loss
-- policy applies to them once `handover_until` has passed (the watchdog's sweep)
ALTER TABLE nodes ADD COLUMN handover_tokens bigint[] NOT NULL DEFAULT '{}';

-- Every instance a node has had; a superseded one is refused if it ever says Hello again, so an old
-- copy that comes back cannot knock the new one off in turn.
CREATE TABLE node_instances (
    node_id             text NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    instance_id         text NOT NULL,
    peer                text NOT NULL DEFAULT '',
    first_seen_at       timestamptz NOT NULL DEFAULT now(),
    superseded_at       timestamptz,
    superseded_by       text,
    PRIMARY KEY (node_id, instance_id)
);

-- What happened to a node, for operators: instances superseded, attempts handed over.
CREATE TABLE node_events (
    id                  bigserial PRIMARY KEY,
    node_id             text NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    at                  timestamptz NOT NULL DEFAULT now(),
    kind                text NOT NULL,
    message             text NOT NULL,
    detail              jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX node_events_node ON node_events (node_id, id);
