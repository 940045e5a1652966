"""Authentication of operators, enrolment of nodes, and the secrets a task receives.

Plaintext secrets exist in server memory only between `resolve` and the Assign that carries them;
they are never logged, never returned by the API, never part of an error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podium.errors import Forbidden, InvalidRequest, NotFound, StoreUnavailable, Unauthorized
from podium.security import tokens
from podium.security.secretbox import SecretBox, write_private
from podium.security.tokens import Role
from podium.store import Store
from podium.store.rows import SecretRow, TokenCheckRow, TokenRow

log = logging.getLogger(__name__)

REGISTRY_PREFIX = "registry:"
# A token an operator presented is kept, and checked again without a round trip to the store, for at
# most this long, and only while this server hears every revocation (`Security.watch_revocations`): a
# revoked token is refused as soon as the revocation's NOTIFY arrives. The time bounds a LISTEN that
# went silent without its connection failing.
TOKEN_KEPT_SECONDS = 5.0
TOKENS_KEPT = 1024  # at most this many at once (dropped all at once past it)
REVOCATIONS = "podium_tokens"  # the channel revoke_token notifies, its payload the token's id
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$")


class SecretMissing(NotFound):
    """A secret a task names no longer exists."""

    def __init__(self, secret: str) -> None:
        super().__init__(f"secret {secret!r} no longer exists")
        self.secret = secret


@dataclass(frozen=True, slots=True)
class Principal:
    token_id: str
    name: str
    role: Role

    @property
    def actor(self) -> str:
        return f"{self.name} ({self.token_id})"


def registry_of(image: str) -> str:
    """The registry host an image is pulled from, as docker resolves it."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def validate_registry_host(host: str) -> str:
    if not _HOST.match(host) or len(host) > 253:
        raise InvalidRequest(f"{host!r} is not a registry host; write it like registry.example.com or localhost:5000")
    return host


class Security:
    def __init__(self, store: Store, box: SecretBox) -> None:
        self.store = store
        self.box = box  # also used by the gateway's own Security, over its own pool
        # The token rows `authenticate` read lately, with when (monotonic): kept only while
        # `watch_revocations` listens (`_listening`), each revocation heard dropping its row. Every
        # revocation heard, and every change of listening, moves `_heard` on: a row read while one
        # came is not kept (its revocation may have been heard before the row was).
        self._kept: dict[str, tuple[TokenCheckRow, float]] = {}
        self._listening = False
        self._heard = 0

    # ---- operators --------------------------------------------------------------------------

    async def watch_revocations(self) -> None:
        """LISTEN for revoked tokens (a server's loop): while it listens, `authenticate` keeps the
        token rows it reads for `TOKEN_KEPT_SECONDS`, and drops a row as soon as its revocation is
        heard, on whichever server it was made. A lost LISTEN drops every row and keeps none until
        it listens again; a row kept from before it listened is dropped once it does (a revocation
        made meanwhile was never heard)."""
        while True:
            try:
                sub = await self.store.listen(REVOCATIONS)
            except StoreUnavailable as e:
                log.warning("cannot listen for revoked tokens (%s); every request reads its token until it can", e)
                await asyncio.sleep(1.0)
                continue
            self._forget(listening=True)
            try:
                while True:
                    self._forget_one((await sub.get()).payload)
            except StoreUnavailable:
                log.warning("lost the LISTEN for revoked tokens; every request reads its token until it listens again")
            finally:
                self._forget(listening=False)
                await sub.close()

    def _forget(self, *, listening: bool) -> None:
        self._kept.clear()
        self._listening = listening
        self._heard += 1

    def _forget_one(self, token_id: str) -> None:
        self._kept.pop(token_id, None)
        self._heard += 1

    def revoked(self, token_id: str) -> None:
        """This server revoked the token (its commit is known): drop its kept row now, not once the
        NOTIFY comes back."""
        self._forget_one(token_id)

    async def _token(self, token_id: str) -> TokenCheckRow | None:
        """The token's row: the one kept if it is fresh, else read (and kept, if no revocation was heard
        while it was read)."""
        now = time.monotonic()
        kept = self._kept.get(token_id)
        if kept is not None and now - kept[1] < TOKEN_KEPT_SECONDS:
            return kept[0]
        heard = self._heard
        row = await self.store.get_token(token_id)
        if row is not None and self._listening and heard == self._heard and row.revoked_at is None:
            if len(self._kept) >= TOKENS_KEPT:
                self._kept.clear()
            self._kept[token_id] = (row, now)
        return row

    async def authenticate(self, authorization: str | None, needed: Role) -> Principal:
        if not authorization:
            raise Unauthorized("this call needs a bearer token (Authorization: Bearer pdm_…; the CLI reads PODIUM_TOKEN)")
        scheme, _, value = authorization.partition(" ")
        parsed = tokens.parse(value.strip()) if scheme.lower() == "bearer" else None
        if parsed is None:
            raise Unauthorized("the Authorization header must be 'Bearer pdm_…'")
        token_id, secret = parsed
        row = await self._token(token_id)
        if row is None or not tokens.matches(secret, row.secret_hash):
            raise Unauthorized("the token is not valid")
        if row.revoked_at is not None:
            raise Unauthorized("the token was revoked")
        role = Role(row.role)
        if role == Role.JOIN:
            raise Forbidden("a join token can only join nodes to the fleet; it cannot call the API")
        if not tokens.allows(role, needed):
            raise Forbidden(f"a {role} token may not do this; it needs the {needed} role")
        return Principal(token_id, row.name, role)

    async def create_token(self, name: str, role: Role, by: str) -> tuple[TokenRow, str]:
        token_id, token, digest = tokens.new_token()
        row = await self.store.insert_token(token_id, name, role, digest, by)
        return row, token

    async def bootstrap(self, data_dir: Path) -> None:
        """On a fresh database, make the first admin token and a join token, and leave them in the
        data directory (owner-only) — the only place their plaintext ever exists."""
        for role, filename, name in ((Role.ADMIN, "admin-token", "bootstrap-admin"), (Role.JOIN, "join-token", "bootstrap-join")):
            if await self.store.active_tokens(role) == 0:
                _row, token = await self.create_token(name, role, by="server bootstrap")
                data_dir.mkdir(parents=True, exist_ok=True)
                write_private(data_dir / filename, (token + "\n").encode())
                log.warning("created the first %s token; it is in %s", role, data_dir / filename)

    # ---- nodes ------------------------------------------------------------------------------

    async def admit_node(self, node_id: str, credential: str, instance_id: str = "") -> str | None:
        """Check a node's Hello credential. Returns a new node credential when a join token enrolled
        the node now (the agent keeps it), None when the node proved it is itself; raises otherwise.

        A join token never takes an enrolled node over, with one exception: the agent instance that
        enrolled it and has never presented the credential since — the stream broke before the
        Welcome that carried it, so it cannot have it — may enrol it again."""
        row = await self.store.node_credential(node_id)
        if row is not None and row.revoked_at is not None:
            raise Forbidden("this node was removed from the fleet")
        if row is not None and row.credential_hash is not None:
            if tokens.node_credential_matches(credential, row.credential_hash):
                if row.enrolled_by_instance is not None:
                    await self.store.confirm_node_credential(node_id)
                return None
            again = instance_id and row.enrolled_by_instance == instance_id and tokens.parse(credential) is not None
            if not again:
                raise Unauthorized(
                    "this node id is enrolled and its credential does not match (a join token cannot take over an enrolled node)"
                )
        parsed = tokens.parse(credential)
        if parsed is None:
            raise Unauthorized("a new node must present a join token (PODIUM_JOIN_TOKEN)")
        trow = await self.store.get_token(parsed[0])
        if (trow is None or trow.role != Role.JOIN or trow.revoked_at is not None
                or not tokens.matches(parsed[1], trow.secret_hash)):
            raise Unauthorized("the join token is not valid")
        credential_out, digest = tokens.new_node_credential()
        if not await self.store.enrol_node(node_id, digest, instance_id):
            raise Unauthorized("this node id was enrolled by another agent just now")
        return credential_out

    # ---- secrets ----------------------------------------------------------------------------

    async def set_secret(self, name: str, value: bytes, actor: str) -> SecretRow:
        nonce, ct = self.box.seal(name, value)
        return await self.store.put_secret(name, nonce, ct, actor)

    async def missing_secrets(self, names: list[str]) -> list[str]:
        have = {r.name for r in await self.store.get_secrets(names)}
        return [n for n in names if n not in have]

    async def registry_credentials(self, image: str) -> tuple[str, str] | None:
        """(username, password) stored for the registry `image` comes from, or None. For the server's
        own calls to that registry (resolving a tag); never logged."""
        name = REGISTRY_PREFIX + registry_of(image)
        rows = await self.store.get_secrets([name])
        if not rows:
            return None
        login = json.loads(self.box.open(name, rows[0].nonce, rows[0].ciphertext))
        return login["username"], login["password"]

    @staticmethod
    def needs_store(spec: dict[str, Any]) -> bool:
        """Whether `resolve` has anything to read for this spec: a secret it names, or the registry
        login of its image. When not, its Assign needs nothing but the spec."""
        return bool(spec.get("secrets") or spec.get("image"))

    async def resolve(self, spec: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        """(env, value) of every secret the spec names, and (registry, user, password) for the
        registry its image comes from, if one is stored. Called just before the Assign is sent.

        Raises SecretMissing (a named secret was deleted), SecretUnreadable (a stored value cannot
        be decrypted with this server's key) or StoreUnavailable (nothing could be read): three
        different things for the task, which the caller must not tell as one."""
        refs = spec.get("secrets") or []
        names = [r["name"] for r in refs]
        registry = registry_of(spec["image"]) if spec.get("image") else None
        if registry:
            names.append(REGISTRY_PREFIX + registry)
        if not names:
            return [], []
        rows = {r.name: r for r in await self.store.get_secrets(names)}
        values: list[tuple[str, str]] = []
        for ref in refs:
            row = rows.get(ref["name"])
            if row is None:
                raise SecretMissing(ref["name"])
            values.append((ref["env"], self.box.open(ref["name"], row.nonce, row.ciphertext).decode()))
        creds: list[tuple[str, str, str]] = []
        if registry and REGISTRY_PREFIX + registry in rows:
            row = rows[REGISTRY_PREFIX + registry]
            login = json.loads(self.box.open(row.name, row.nonce, row.ciphertext))
            creds.append((registry, login["username"], login["password"]))
        return values, creds
