"""Named specs: store a revision, list them, read one (or one revision), submit one."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from podium.api.deps import Admission, Operator, StoreDep, Viewer, audit, checked_name
from podium.api.models import NamedSpecOut, SubmitNamedIn, SubmitResponse, named_spec_out
from podium.api.paging import ERRORS
from podium.api.routes.tasks import SUBMIT, submitted
from podium.spec import TaskSpec

router = APIRouter()


@router.put("/v1/specs/{name}", response_model=NamedSpecOut, status_code=201, responses=ERRORS)
async def put_spec(name: str, body: TaskSpec, who: Operator, store: StoreDep) -> NamedSpecOut:
    """Store a new revision of a named spec."""
    row = await store.put_named_spec(checked_name(name), body, actor=who.actor)
    await audit(store, who, "spec.put", name, revision=row.revision)
    return named_spec_out(row)


@router.get("/v1/specs", response_model=list[NamedSpecOut], responses=ERRORS)
async def list_specs(_who: Viewer, store: StoreDep) -> list[NamedSpecOut]:
    return [named_spec_out(r) for r in await store.list_named_specs()]


@router.get("/v1/specs/{name}", response_model=NamedSpecOut, responses=ERRORS)
async def get_spec(name: str, _who: Viewer, store: StoreDep, revision: Annotated[int | None, Query(ge=1)] = None) -> NamedSpecOut:
    return named_spec_out(await store.named_spec(checked_name(name), revision))


@router.post("/v1/specs/{name}/submit", response_model=SubmitResponse, status_code=201, responses=SUBMIT)
async def submit_spec(name: str, body: SubmitNamedIn, who: Operator, store: StoreDep, admission: Admission) -> Any:
    """Submit the named spec. With `revision`, refused (409) unless that is still the current one."""
    admission.admit()
    row, created = await store.submit_named(checked_name(name), body.revision, idempotency_key=body.idempotency_key, actor=who.actor)
    return submitted(row, created)
