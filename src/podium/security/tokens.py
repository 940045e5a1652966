"""Bearer tokens. A token is `pdm_<id>.<secret>`: the id is public (listings, the audit log), the
secret is random and stored only as its SHA-256. A plain hash is enough: the secret has 256 bits of
entropy, so there is nothing to brute-force that a slow hash would protect."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from enum import StrEnum

PREFIX = "pdm_"
NODE_PREFIX = "pdn_"


class Role(StrEnum):
    VIEWER = "viewer"  # may read everything an operator sees
    OPERATOR = "operator"  # may also submit, cancel, drain, label, and manage named specs
    ADMIN = "admin"  # may also manage tokens, secrets, registries, and remove nodes
    JOIN = "join"  # may only join new nodes to the fleet; never calls the API


_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3, Role.JOIN: 0}


def allows(role: Role | str, needed: Role) -> bool:
    return _RANK[Role(role)] >= _RANK[needed] and Role(role) != Role.JOIN


def new_token() -> tuple[str, str, bytes]:
    """(id, the full token to give out once, the hash to store)."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return token_id, f"{PREFIX}{token_id}.{secret}", digest(secret)


def parse(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    if not token.startswith(PREFIX) or "." not in token:
        return None
    token_id, _, secret = token[len(PREFIX) :].partition(".")
    if not token_id or not secret or len(token) > 200:
        return None
    return token_id, secret


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def matches(secret: str, stored: bytes) -> bool:
    return hmac.compare_digest(digest(secret), bytes(stored))


def new_node_credential() -> tuple[str, bytes]:
    secret = secrets.token_urlsafe(32)
    return f"{NODE_PREFIX}{secret}", digest(secret)


def node_credential_matches(credential: str, stored: bytes | None) -> bool:
    if stored is None or not credential.startswith(NODE_PREFIX):
        return False
    return matches(credential[len(NODE_PREFIX) :], stored)
