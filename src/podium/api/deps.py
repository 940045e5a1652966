"""What every router's handlers are given, as FastAPI dependencies: the caller (a bearer token of at
least a role), the store, the scheduler, the security service, admission and the event hub from `app.state` (set
by the app factory), and the small parsers of path and header values several nouns share. Handlers
declare these in their signatures; no handler reaches a closure or a module global for them."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from podium.api.events import EventHub
from podium.errors import InvalidRequest
from podium.pressure import Pressure
from podium.scheduler.service import Scheduler
from podium.security.service import Principal, Security
from podium.security.tokens import Role
from podium.spec import validate_name
from podium.store import Store

_bearer = HTTPBearer(auto_error=False, description="an operator token: pdm_<id>.<secret>")


def _needs(role: Role) -> Any:
    async def check(request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
        header = f"{cred.scheme} {cred.credentials}" if cred is not None else None
        security: Security = request.app.state.security
        return await security.authenticate(header, role)

    return Depends(check)


# Module-level so FastAPI can resolve them from the handlers' (string) annotations.
Viewer = Annotated[Principal, _needs(Role.VIEWER)]
Operator = Annotated[Principal, _needs(Role.OPERATOR)]
Admin = Annotated[Principal, _needs(Role.ADMIN)]


# Coroutines, though they only read `app.state`: FastAPI runs a plain function dependency in its
# thread pool, a hop to a worker thread and back for each (three on every submission).
async def _store(request: Request) -> Store:
    return request.app.state.store


async def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def _security(request: Request) -> Security:
    return request.app.state.security


async def _admission(request: Request) -> Pressure:
    return request.app.state.admission


async def _event_hub(request: Request) -> EventHub:
    return request.app.state.event_hub


StoreDep = Annotated[Store, Depends(_store)]
SchedulerDep = Annotated[Scheduler, Depends(_scheduler)]
SecurityDep = Annotated[Security, Depends(_security)]
Admission = Annotated[Pressure, Depends(_admission)]
EventHubDep = Annotated[EventHub, Depends(_event_hub)]


async def audit(store: Store, who: Principal, action: str, target: str | None, **detail: Any) -> None:
    await store.audit(who.actor, action, target, detail)


def checked_name(name: str) -> str:
    try:
        return validate_name(name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


# An id prefix as git and docker take them: hex digits (a uuid's dashes allowed), at most a whole uuid.
_UUID_PREFIX = re.compile(r"^[0-9a-fA-F][0-9a-fA-F-]{0,35}$")


async def task_ref(store: Store, ref: str) -> uuid.UUID:
    """A task id, or a unique prefix of one (resolved by a range scan of the primary key)."""
    try:
        return uuid.UUID(ref)
    except ValueError:
        pass
    if not _UUID_PREFIX.match(ref) or len(ref.replace("-", "")) > 32:
        raise InvalidRequest(f"{ref[:80]!r} is not a task id; task ids are UUIDs like 3f2a…, or a unique start of one")
    return await store.resolve_task(ref)


def revision_of(if_match: str | None) -> int | None:
    """An If-Match header's revision: `3`, `"3"` or `W/"3"`; `*` (or none) means any."""
    if if_match is None or if_match.strip() == "*":
        return None
    value = if_match.strip().removeprefix("W/").strip('"')
    if not value.isdigit() or len(value) > 18:
        raise InvalidRequest(f"If-Match: {if_match[:40]!r} is not a revision; send the revision (the ETag), e.g. If-Match: \"3\"")
    return int(value)
