-- insert_token --
INSERT INTO api_tokens (id, name, role, secret_hash, created_by) VALUES ($1, $2, $3, $4, $5)
RETURNING id, name, role, created_at, created_by, revoked_at

-- get_token --
SELECT * FROM api_tokens WHERE id = $1

-- list_tokens --
SELECT id, name, role, created_at, created_by, revoked_at FROM api_tokens ORDER BY created_at, id

-- revoke_token --
-- Every server that keeps tokens it checked (`Security.watch_revocations`) is told, once this commits.
WITH r AS (
    UPDATE api_tokens SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL
    RETURNING id, name, role, created_at, created_by, revoked_at
), told AS (
    SELECT pg_notify('podium_tokens', id) FROM r
)
SELECT r.* FROM r WHERE (SELECT count(*) FROM told) >= 0

-- active_token_count --
SELECT count(*) FROM api_tokens WHERE role = $1 AND revoked_at IS NULL

-- put_secret --
INSERT INTO secrets (name, version, nonce, ciphertext, updated_by) VALUES ($1, 1, $2, $3, $4)
ON CONFLICT (name) DO UPDATE SET version = secrets.version + 1, nonce = EXCLUDED.nonce,
    ciphertext = EXCLUDED.ciphertext, updated_at = now(), updated_by = EXCLUDED.updated_by
RETURNING name, version, created_at, updated_at, updated_by

-- list_secrets --
SELECT name, version, created_at, updated_at, updated_by FROM secrets ORDER BY name

-- delete_secret --
DELETE FROM secrets WHERE name = $1 RETURNING name

-- get_secrets --
SELECT name, nonce, ciphertext FROM secrets WHERE name = ANY($1::text[])

-- audit --
INSERT INTO audit_log (actor, action, target, detail) VALUES ($1, $2, $3, $4)

-- read_audit --
-- One page of the audit log, newest first, before entry $2 (the first page passes NULL).
SELECT * FROM audit_log WHERE $2::bigint IS NULL OR id < $2 ORDER BY id DESC LIMIT $1

-- count_audit_after --
SELECT count(*) FROM (SELECT 1 FROM audit_log WHERE $2::bigint IS NULL OR id < $2 LIMIT $1) x

-- tokens_by_prefix --
SELECT id, name, role, created_at, created_by, revoked_at FROM api_tokens
WHERE starts_with(id, $1) AND revoked_at IS NULL ORDER BY id LIMIT $2

-- node_credential --
SELECT id, credential_hash, revoked_at, enrolled_by_instance FROM nodes WHERE id = $1

-- set_node_credential --
-- Only for a node that has none yet: a join token can enrol a node, never take one over — save for
-- the agent instance ($3) that enrolled it and has not presented its credential since (it never got
-- the Welcome that carried it), which may enrol it again.
INSERT INTO nodes (id, name, credential_hash, enrolled_by_instance) VALUES ($1, $1, $2, NULLIF($3, ''))
ON CONFLICT (id) DO UPDATE SET credential_hash = EXCLUDED.credential_hash, enrolled_by_instance = EXCLUDED.enrolled_by_instance
WHERE nodes.revoked_at IS NULL
  AND (nodes.credential_hash IS NULL OR (NULLIF($3, '') IS NOT NULL AND nodes.enrolled_by_instance = $3))
RETURNING id

-- confirm_node_credential --
-- The node presented its credential: it has it, and nothing may enrol it again.
UPDATE nodes SET enrolled_by_instance = NULL WHERE id = $1 AND enrolled_by_instance IS NOT NULL

-- revoke_node --
UPDATE nodes SET revoked_at = now(), connected = false, gateway_id = NULL, health = 'offline', updated_at = now()
WHERE id = $1 AND revoked_at IS NULL
RETURNING id, pg_notify('podium_revoked', id)
