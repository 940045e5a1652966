"""Registry logins: stored as a secret named after the registry, sent only with tasks whose image
comes from that registry."""

from __future__ import annotations

import json

from fastapi import APIRouter

from podium.api.deps import Admin, SecurityDep, StoreDep, audit
from podium.api.models import RegistryLoginIn, SecretOut
from podium.api.paging import ERRORS
from podium.security.service import REGISTRY_PREFIX, validate_registry_host

router = APIRouter()


@router.put("/v1/registries/{host}", response_model=SecretOut, status_code=201, responses=ERRORS)
async def registry_login(host: str, body: RegistryLoginIn, who: Admin, store: StoreDep, security: SecurityDep) -> SecretOut:
    """Store a registry login; it is sent only with tasks whose image comes from that registry."""
    name = REGISTRY_PREFIX + validate_registry_host(host)
    value = json.dumps({"username": body.username, "password": body.password}).encode()
    row = await security.set_secret(name, value, who.actor)
    await audit(store, who, "registry.login", host, username=body.username)
    return SecretOut.model_validate(row, from_attributes=True)
