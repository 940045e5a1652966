"""The audit log: who did what, newest first."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from podium.api.deps import Admin, StoreDep
from podium.api.models import AuditOut
from podium.api.paging import AFTER_DOC, COUNT_DOC, PAGED, REMAINING_CAP, cursor, page, uncursor

router = APIRouter()


@router.get("/v1/audit", response_model=list[AuditOut], responses=PAGED)
async def read_audit(
    _who: Admin,
    store: StoreDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=10000, description="entries per page")] = 100,
    after: Annotated[str | None, Query(max_length=512, description=AFTER_DOC)] = None,
    count: Annotated[bool, Query(description=COUNT_DOC)] = False,
) -> list[AuditOut]:
    """Who did what, newest first, one page at a time (see `GET /v1/tasks` for paging)."""
    cur = uncursor("audit", after, (int,))
    rows = list(await store.read_audit(limit + 1, cur[0] if cur else None))
    remaining = None
    if count:
        remaining = await store.count_audit_after(rows[limit - 1].id, REMAINING_CAP) if len(rows) > limit else 0
    rows = page(request, response, rows, limit, lambda r: cursor("audit", r.id), remaining)
    return [AuditOut.model_validate(r, from_attributes=True) for r in rows]
