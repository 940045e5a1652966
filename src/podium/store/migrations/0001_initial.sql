-- Podium's schema. Every fact the control plane acts on lives here; nothing that matters lives
-- only in a server's memory. Times are written with the database clock (now()), never a server's.

CREATE TABLE nodes (
    id                  text PRIMARY KEY,               -- stable: kept in the agent's state dir
    name                text NOT NULL,
    pool                text NOT NULL DEFAULT 'default',
    arch                text NOT NULL DEFAULT 'x86_64',
    labels              jsonb NOT NULL DEFAULT '{}',
    capabilities        text[] NOT NULL DEFAULT '{}',
    backends            text[] NOT NULL DEFAULT '{process}',
    artifacts           text[] NOT NULL DEFAULT '{}',
    protocol_min        int NOT NULL DEFAULT 1,
    protocol_max        int NOT NULL DEFAULT 1,
    gpu_indexes         int[] NOT NULL DEFAULT '{}',
    -- what the node offers
    alloc_cpu_millis    bigint NOT NULL DEFAULT 0,
    alloc_memory_bytes  bigint NOT NULL DEFAULT 0,
    alloc_disk_bytes    bigint NOT NULL DEFAULT 0,
    alloc_gpus          int NOT NULL DEFAULT 0,
    alloc_slots         int NOT NULL DEFAULT 0,
    -- what live attempts hold; written in the same statement as the attempt that takes or frees it
    res_cpu_millis      bigint NOT NULL DEFAULT 0,
    res_memory_bytes    bigint NOT NULL DEFAULT 0,
    res_disk_bytes      bigint NOT NULL DEFAULT 0,
    res_gpus            int NOT NULL DEFAULT 0,
    res_slots           int NOT NULL DEFAULT 0,
    health              text NOT NULL DEFAULT 'online' CHECK (health IN ('online', 'unreachable', 'offline')),
    draining            boolean NOT NULL DEFAULT false,
    connected           boolean NOT NULL DEFAULT false,
    gateway_id          text,                           -- the server replica holding the stream
    session             bigint NOT NULL DEFAULT 0,      -- grows with every Hello
    last_heartbeat_at   timestamptz,
    connected_at        timestamptz,
    revoked_at          timestamptz,
    labels_overridden   boolean NOT NULL DEFAULT false,  -- an operator set the labels; the agent no longer does
    agent_version       text NOT NULL DEFAULT '',
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- A node can never hold more than it offers, whatever two schedulers believe at once.
    CONSTRAINT reserved_within_allocatable CHECK (
        res_cpu_millis >= 0 AND res_memory_bytes >= 0 AND res_disk_bytes >= 0 AND res_gpus >= 0 AND res_slots >= 0
        AND res_cpu_millis <= alloc_cpu_millis AND res_memory_bytes <= alloc_memory_bytes
        AND res_disk_bytes <= alloc_disk_bytes AND res_gpus <= alloc_gpus AND res_slots <= alloc_slots)
);

CREATE SEQUENCE fencing_tokens;

CREATE TABLE tasks (
    id                  uuid PRIMARY KEY,
    name                text,
    spec                jsonb NOT NULL,
    state               text NOT NULL CHECK (state IN ('queued', 'assigned', 'provisioning', 'running',
                            'cancelling', 'succeeded', 'failed', 'cancelled', 'lost')),
    reason              text,
    priority            int NOT NULL DEFAULT 0,
    -- copied out of the spec so placement and the watchdog never parse JSON on the hot path
    cpu_millis          bigint NOT NULL,
    memory_bytes        bigint NOT NULL,
    disk_bytes          bigint NOT NULL DEFAULT 0,
    gpus                int NOT NULL DEFAULT 0,
    timeout_seconds     double precision,
    max_attempts        int NOT NULL,
    requeue_on_node_loss boolean NOT NULL,
    attempts            int NOT NULL DEFAULT 0,         -- how many attempts have been made
    -- the current attempt, while the task is on a node
    node_id             text REFERENCES nodes(id),
    fencing_token       bigint,
    lease_expires_at    timestamptz,
    accept_deadline     timestamptz,
    started_at          timestamptz,                    -- the current attempt's running time
    cancel_requested_at timestamptz,
    cancel_reason       text,                           -- why it is being stopped: cancelled or timeout
    exit_code           int,
    idempotency_key     text UNIQUE,
    submitted_by        text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz
);

-- The dispatch claim: only queued rows, in the order they are claimed. Stays small and fast however
-- many finished tasks the table holds.
CREATE INDEX tasks_queued ON tasks (priority DESC, created_at, id) WHERE state = 'queued';
-- The watchdog's sweeps touch only tasks that are on a node.
CREATE INDEX tasks_on_node ON tasks (node_id) WHERE state IN ('assigned', 'provisioning', 'running', 'cancelling');
CREATE INDEX tasks_created ON tasks (created_at DESC, id);
CREATE INDEX tasks_state_created ON tasks (state, created_at DESC);

CREATE TABLE attempts (
    task_id             uuid NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    attempt             int NOT NULL,
    fencing_token       bigint NOT NULL UNIQUE,
    node_id             text NOT NULL REFERENCES nodes(id),
    state               text NOT NULL CHECK (state IN ('assigned', 'provisioning', 'running', 'exited',
                            'revoked', 'lost', 'stopped', 'failed')),
    -- the capacity this attempt holds on its node until it ends
    cpu_millis          bigint NOT NULL,
    memory_bytes        bigint NOT NULL,
    disk_bytes          bigint NOT NULL,
    gpus                int NOT NULL,
    gpu_indexes         int[] NOT NULL DEFAULT '{}',
    released            boolean NOT NULL DEFAULT false,
    assigned_at         timestamptz NOT NULL DEFAULT now(),
    accept_deadline     timestamptz NOT NULL,
    delivered_at        timestamptz,                    -- when a gateway pushed the Assign
    provisioning_at     timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz,
    stop_requested_at   timestamptz,                    -- the node must be told to stop it
    stop_sent_at        timestamptz,
    exit_code           int,
    reason              text,
    PRIMARY KEY (task_id, attempt)
);

-- What a gateway still owes a node: Assigns not yet pushed, stops not yet sent.
CREATE INDEX attempts_outbox ON attempts (node_id)
    WHERE (delivered_at IS NULL AND state = 'assigned') OR (stop_requested_at IS NOT NULL AND stop_sent_at IS NULL);

CREATE TABLE task_events (
    id                  bigserial PRIMARY KEY,
    task_id             uuid NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    at                  timestamptz NOT NULL DEFAULT now(),
    from_state          text,
    to_state            text NOT NULL,
    reason              text,
    actor               text NOT NULL,
    fencing_token       bigint
);
CREATE INDEX task_events_task ON task_events (task_id, id);

CREATE TABLE log_chunks (
    task_id             uuid NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    fencing_token       bigint NOT NULL,
    stream              text NOT NULL CHECK (stream IN ('stdout', 'stderr')),
    seq                 bigint NOT NULL,
    id                  bigserial,
    at                  timestamptz NOT NULL DEFAULT now(),
    data                bytea NOT NULL,
    PRIMARY KEY (task_id, fencing_token, stream, seq)
);
CREATE INDEX log_chunks_follow ON log_chunks (task_id, id);
