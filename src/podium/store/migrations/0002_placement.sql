-- Placement, all of it: GPU indexes that two schedulers can never hand out twice, and named specs
-- with revisions (the seed's ProfileRevision: a submission pinned to a stale revision is refused).

CREATE TABLE gpu_claims (
    node_id             text NOT NULL REFERENCES nodes(id),
    gpu_index           int NOT NULL,
    fencing_token       bigint NOT NULL,
    PRIMARY KEY (node_id, gpu_index)
);
CREATE INDEX gpu_claims_token ON gpu_claims (fencing_token);

CREATE TABLE named_specs (
    name                text NOT NULL,
    revision            int NOT NULL,
    spec                jsonb NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    created_by          text NOT NULL DEFAULT 'api',
    PRIMARY KEY (name, revision)
);

ALTER TABLE tasks ADD COLUMN spec_name text, ADD COLUMN spec_revision int;
