"""Operator tokens: create (the value is shown once), list, revoke."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from podium.api.deps import Admin, SecurityDep, StoreDep, audit
from podium.api.models import TokenCreated, TokenIn, TokenOut
from podium.api.paging import ERRORS
from podium.errors import InvalidRequest
from podium.store.rows import TokenRow

router = APIRouter()


def _token_fields(r: TokenRow) -> dict[str, Any]:
    return {"id": r.id, "name": r.name, "role": r.role, "created_at": r.created_at, "created_by": r.created_by,
            "revoked_at": r.revoked_at}  # fmt: skip


@router.post("/v1/tokens", response_model=TokenCreated, status_code=201, responses=ERRORS)
async def create_token(body: TokenIn, who: Admin, store: StoreDep, security: SecurityDep) -> TokenCreated:
    """Create a token. Its value is in this answer and nowhere else, ever."""
    row, token = await security.create_token(body.name, body.role, by=who.actor)
    await audit(store, who, "token.create", row.id, name=body.name, role=body.role)
    return TokenCreated(**_token_fields(row), token=token)


@router.get("/v1/tokens", response_model=list[TokenOut], responses=ERRORS)
async def list_tokens(_who: Admin, store: StoreDep) -> list[TokenOut]:
    return [TokenOut(**_token_fields(r)) for r in await store.list_tokens()]


@router.delete("/v1/tokens/{token_id}", response_model=TokenOut, responses=ERRORS)
async def revoke_token(token_id: str, who: Admin, store: StoreDep, security: SecurityDep) -> TokenOut:
    """Revoke a token; it stops working at once."""
    if len(token_id) > 64:
        raise InvalidRequest("a token id is at most 64 characters")
    row = await store.revoke_token(token_id)
    security.revoked(row.id)  # here at once; every other server once it hears the NOTIFY
    await audit(store, who, "token.revoke", row.id)
    return TokenOut(**_token_fields(row))
