"""Who is calling, for the event stream and the web UI: a bearer token (as every /v1/ call), or the
UI's sign-in session cookie. A session is a random secret in an HttpOnly, SameSite=Strict cookie;
the database holds only its hash, mapped to the token that signed in, so revoking the token ends
every session it opened. Each session carries a CSRF token that every state-changing form must send
back; this module checks it and must never let a form POST through without it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

from podium.errors import Forbidden, Unauthorized
from podium.security import tokens
from podium.security.service import Principal, Security
from podium.security.tokens import Role
from podium.store.ui import UiStore

COOKIE = "podium_session"
SESSION_SECONDS = 12 * 3600.0


class SignedOut(Exception):
    """The browser has no valid session: the UI sends it to the sign-in page."""


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class Sessions:
    def __init__(self, ui: UiStore, security: Security) -> None:
        self.ui = ui
        self.security = security

    async def sign_in(self, token: str) -> tuple[str, Principal]:
        """Check a token as the API would and open a session for it; (cookie value, principal)."""
        principal = await self.security.authenticate(f"Bearer {token.strip()}", Role.VIEWER)
        secret = secrets.token_urlsafe(32)
        await self.ui.create_session(_hash(secret), principal.token_id, secrets.token_urlsafe(32), SESSION_SECONDS)
        return secret, principal

    async def sign_out(self, cookie: str | None) -> None:
        if cookie:
            await self.ui.end_session(_hash(cookie))

    async def session(self, request: Request) -> tuple[Principal, str] | None:
        """(principal, CSRF token) of the request's session cookie, or None."""
        cookie = request.cookies.get(COOKIE)
        if not cookie or len(cookie) > 200:
            return None
        row = await self.ui.session(_hash(cookie))
        if row is None or row.role == Role.JOIN:
            return None
        return Principal(row.token_id, row.name, Role(row.role)), row.csrf

    async def caller(self, request: Request, needed: Role) -> Principal:
        """A bearer token if the request has one, else the session cookie."""
        header = request.headers.get("authorization")
        if header:
            return await self.security.authenticate(header, needed)
        found = await self.session(request)
        if found is None:
            raise Unauthorized("this call needs a bearer token (Authorization: Bearer pdm_…) or a signed-in UI session")
        principal, _csrf = found
        if not tokens.allows(principal.role, needed):
            raise Forbidden(f"a {principal.role} token may not do this; it needs the {needed} role")
        return principal


def csrf_ok(expected: str, sent: str | None) -> bool:
    return bool(sent) and hmac.compare_digest(expected.encode(), (sent or "").encode())
