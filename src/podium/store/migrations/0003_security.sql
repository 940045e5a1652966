-- Who may do what, and secrets that stay secret. Tokens and node credentials are stored only as
-- hashes; secret values only as AES-GCM ciphertext.

CREATE TABLE api_tokens (
    id                  text PRIMARY KEY,                -- the public half, shown in listings
    name                text NOT NULL,
    role                text NOT NULL CHECK (role IN ('admin', 'operator', 'viewer', 'join')),
    secret_hash         bytea NOT NULL,                  -- sha256 of the secret half
    created_at          timestamptz NOT NULL DEFAULT now(),
    created_by          text NOT NULL,
    revoked_at          timestamptz
);

ALTER TABLE nodes ADD COLUMN credential_hash bytea;

CREATE TABLE secrets (
    name                text PRIMARY KEY,                -- a user secret, or "registry:<host>"
    version             int NOT NULL,
    nonce               bytea NOT NULL,
    ciphertext          bytea NOT NULL,                  -- AES-GCM, the name as associated data
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text NOT NULL
);

CREATE TABLE audit_log (
    id                  bigserial PRIMARY KEY,
    at                  timestamptz NOT NULL DEFAULT now(),
    actor               text NOT NULL,                   -- the token's name and id
    action              text NOT NULL,
    target              text,
    detail              jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_at ON audit_log (at DESC);
