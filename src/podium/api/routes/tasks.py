"""Tasks: submit (one, a batch, or a dry-run check), list, read, cancel, explain, and a task's history."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from podium import reasons
from podium.api.deps import Admission, Operator, SchedulerDep, SecurityDep, StoreDep, Viewer, audit, revision_of, task_ref
from podium.api.models import (
    BatchIn,
    CheckOut,
    ErrorOut,
    EventOut,
    ExplainOut,
    SubmitResponse,
    TaskDetail,
    TaskOut,
    VerdictOut,
    attempt_out,
    event_out,
    task_out,
)  # fmt: skip
from podium.api.paging import AFTER_DOC, COUNT_DOC, ERRORS, PAGED, REMAINING_CAP, cursor, page, uncursor
from podium.errors import InvalidRequest
from podium.spec import SubmitRequest
from podium.states import TaskState
from podium.store.rows import TaskRow

router = APIRouter()

# A submission whose idempotency key was used before answers 200 with the task that key made.
SUBMIT = {
    **ERRORS,
    200: {"model": SubmitResponse, "description": "the task an earlier submission with this idempotency key made"},
    429: {"model": ErrorOut, "description": "the server is overloaded and stored nothing; retry after Retry-After seconds"},
}
_SUBMIT_BATCH = {**ERRORS, 429: SUBMIT[429]}


def submitted(row: TaskRow, created: bool) -> JSONResponse:
    """A submission's answer: 201 with the new task, or 200 with the one its idempotency key made."""
    resp = SubmitResponse(task=task_out(row), created=created)
    return JSONResponse(json.loads(resp.model_dump_json()), status_code=201 if created else 200)


@router.post("/v1/tasks", response_model=SubmitResponse, status_code=201, responses=SUBMIT)
async def submit(
    body: SubmitRequest, who: Operator, scheduler: SchedulerDep, security: SecurityDep, admission: Admission
) -> Any:
    """Submit a task. With an `idempotency_key` already used, returns that task (200) instead."""
    missing = await security.missing_secrets([r.name for r in body.secrets]) if body.secrets else []
    if missing:
        raise InvalidRequest(
            f"secrets: {', '.join(repr(m) for m in missing)} do{'es' if len(missing) == 1 else ''} not exist; "
            "create them with `podium secret set NAME` first"
        )
    admission.admit()
    [(row, created)] = await scheduler.submit_many([(body.task_spec(), body.idempotency_key)], actor=who.actor)
    return submitted(row, created)


@router.post("/v1/tasks/check", response_model=CheckOut, responses=ERRORS)
async def check(body: SubmitRequest, _who: Viewer, scheduler: SchedulerDep) -> CheckOut:
    """Dry run: could any node of the fleet ever run this spec, and why not each node (hard
    compatibility only, ignoring what is free, connected or draining now). Stores nothing."""
    spec = body.task_spec()
    r = spec.resources
    verdicts = await scheduler.check(json.loads(spec.model_dump_json()), r.cpu, r.memory, r.disk, r.gpus)
    runnable = any(v.failed is None for v, _row in verdicts)
    return CheckOut(
        runnable=runnable, reason=None if runnable else reasons.NO_COMPATIBLE_RUNNER,
        nodes=[VerdictOut(node_id=v.node_id, name=row.name, fits=v.failed is None, failed=v.failed, score=None,
                          avoided=False, health=row.health) for v, row in verdicts],
    )  # fmt: skip


@router.post("/v1/tasks/batch", response_model=list[SubmitResponse], responses=_SUBMIT_BATCH)
async def submit_batch(
    body: BatchIn, who: Operator, scheduler: SchedulerDep, security: SecurityDep, admission: Admission
) -> list[SubmitResponse]:
    """Submit up to 1,000 tasks in one transaction: all are stored, or none (a reused idempotency
    key with a different spec refuses the whole batch). Each answer is what a single submit gives."""
    names = sorted({r.name for t in body.tasks for r in t.secrets})
    missing = await security.missing_secrets(names) if names else []
    if missing:
        raise InvalidRequest(f"secrets: {', '.join(repr(m) for m in missing)} do not exist; create them first")
    admission.admit(len(body.tasks))
    rows = await scheduler.submit_many([(t.task_spec(), t.idempotency_key) for t in body.tasks], actor=who.actor)
    return [SubmitResponse(task=task_out(r), created=c) for r, c in rows]


@router.get("/v1/tasks", response_model=list[TaskOut], responses=PAGED)
async def list_tasks(
    _who: Viewer,
    store: StoreDep,
    request: Request,
    response: Response,
    state: Annotated[TaskState | None, Query(description="only tasks in this state")] = None,
    node: Annotated[str | None, Query(max_length=128)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="tasks per page")] = 100,
    after: Annotated[str | None, Query(max_length=512, description=AFTER_DOC)] = None,
    count: Annotated[bool, Query(description=COUNT_DOC)] = False,
) -> list[TaskOut]:
    """Tasks, newest first (created_at, then id, descending), one page at a time: follow the
    `Link: <…>; rel="next"` header (absent on the last page) to read the next one."""
    cur = uncursor("tasks", after, (datetime, uuid.UUID))
    pos = (cur[0], cur[1]) if cur else None
    filters = {"state": state.value if state else None, "node_id": node, "name": name}
    rows = list(await store.list_tasks(**filters, limit=limit + 1, after=pos))
    remaining = None
    if count:
        last = (rows[limit - 1].created_at, rows[limit - 1].id) if len(rows) > limit else None
        remaining = await store.count_tasks_after(**filters, after=last, cap=REMAINING_CAP) if last else 0
    rows = page(request, response, rows, limit, lambda r: cursor("tasks", r.created_at.isoformat(), str(r.id)), remaining)
    nodes = await store.last_attempt_nodes([r.id for r in rows])
    return [task_out(r, nodes.get(r.id)) for r in rows]


@router.get("/v1/tasks/{task_id}", response_model=TaskDetail, responses=ERRORS)
async def get_task(task_id: str, _who: Viewer, store: StoreDep, response: Response) -> TaskDetail:
    task, attempts, events = await store.task_detail(await task_ref(store, task_id))
    last = (await store.last_attempt_nodes([task.id])).get(task.id)
    response.headers["ETag"] = f'"{task.revision}"'
    return TaskDetail(
        **task_out(task, last).model_dump(), attempt_list=[attempt_out(a) for a in attempts], events=[event_out(e) for e in events]
    )


@router.post("/v1/tasks/{task_id}/cancel", response_model=TaskOut, responses=ERRORS)
async def cancel(
    task_id: str,
    who: Operator,
    store: StoreDep,
    scheduler: SchedulerDep,
    response: Response,
    if_match: Annotated[str | None, Header(description="the task's revision (its ETag): refuse (412) if it changed since")] = None,
) -> TaskOut:
    """Cancel a task: a queued one ends at once, one on a node is stopped there (SIGTERM, then
    SIGKILL after the grace); a task already ended is returned unchanged. With `If-Match`, only
    if the task is still at that revision."""
    tid = await task_ref(store, task_id)
    row = await scheduler.cancel(tid, actor=who.actor, if_revision=revision_of(if_match))
    await audit(store, who, "task.cancel", str(tid), state=row.state)
    response.headers["ETag"] = f'"{row.revision}"'
    return task_out(row)


@router.get("/v1/tasks/{task_id}/explain", response_model=ExplainOut, responses=ERRORS)
async def explain(task_id: str, _who: Viewer, store: StoreDep, scheduler: SchedulerDep) -> ExplainOut:
    """Why is my task still queued? Every node with the first check it fails, or its score."""
    task, verdicts, avoid = await scheduler.explain(await task_ref(store, task_id))
    return ExplainOut(
        task_id=task.id, state=task.state, reason=task.reason, node_id=task.node_id,
        nodes=[VerdictOut(node_id=v.node_id, name=row.name if row else v.node_id, fits=v.failed is None,
                          failed=v.failed, score=v.score, avoided=v.node_id in avoid,
                          health=row.health if row else None, holds=list(v.holds)) for v, row in verdicts],
    )  # fmt: skip


@router.get("/v1/tasks/{task_id}/events", response_model=list[EventOut], responses=PAGED)
async def task_events(
    task_id: str,
    _who: Viewer,
    store: StoreDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000, description="events per page")] = 100,
    after: Annotated[str | None, Query(max_length=512, description=AFTER_DOC)] = None,
) -> list[EventOut]:
    """A task's history in the order it happened, one page at a time (see `GET /v1/tasks` for paging)."""
    cur = uncursor("events", after, (int,))
    rows = list(await store.task_events(await task_ref(store, task_id), cur[0] if cur else 0, limit + 1))
    rows = page(request, response, rows, limit, lambda r: cursor("events", r.id), None)
    return [event_out(e) for e in rows]
