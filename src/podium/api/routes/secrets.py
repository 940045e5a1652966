"""Secrets: set (encrypted at rest), list names and versions (never values), delete."""

from __future__ import annotations

from fastapi import APIRouter, Response

from podium.api.deps import Admin, Operator, SecurityDep, StoreDep, audit, checked_name
from podium.api.models import SecretIn, SecretOut
from podium.api.paging import ERRORS
from podium.security.service import REGISTRY_PREFIX

router = APIRouter()


@router.put("/v1/secrets/{name}", response_model=SecretOut, status_code=201, responses=ERRORS)
async def set_secret(name: str, body: SecretIn, who: Admin, store: StoreDep, security: SecurityDep) -> SecretOut:
    """Create or replace a secret. The value is encrypted at rest and never returned."""
    row = await security.set_secret(checked_name(name), body.value.encode(), who.actor)
    await audit(store, who, "secret.set", name, version=row.version)
    return SecretOut.model_validate(row, from_attributes=True)


@router.get("/v1/secrets", response_model=list[SecretOut], responses=ERRORS)
async def list_secrets(_who: Operator, store: StoreDep) -> list[SecretOut]:
    """Names, versions and times; never values."""
    return [SecretOut.model_validate(r, from_attributes=True) for r in await store.list_secrets()]


@router.delete("/v1/secrets/{name}", status_code=204, responses=ERRORS)
async def delete_secret(name: str, who: Admin, store: StoreDep) -> Response:
    await store.delete_secret(name if name.startswith(REGISTRY_PREFIX) else checked_name(name))
    await audit(store, who, "secret.delete", name)
    return Response(status_code=204)
