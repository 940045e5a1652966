"""The REST API. Every handler validates its input before touching the store, so bad input gets a
4xx that names the field and the problem and changes nothing; a database that is away is a 503,
never a 500."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from podium import __version__
from podium.api.models import (
    ErrorOut, ExplainOut, LabelsIn, LogChunkOut, LogsOut, NamedSpecOut, NodeOut, SubmitNamedIn, SubmitResponse,
    TaskDetail, TaskOut, VerdictOut, attempt_out, event_out, named_spec_out, node_out, task_out,
)  # fmt: skip
from podium.errors import Conflict, InvalidRequest, NotFound, StoreUnavailable
from podium.scheduler.service import Scheduler
from podium.spec import SubmitRequest, TaskSpec, validate_name
from podium.states import TERMINAL, TaskState
from podium.store import Store

MAX_BODY = 1024 * 1024
FOLLOW_POLL = 0.1  # seconds between reads while following logs
_ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}, 503: {"model": ErrorOut}}


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def _validation_message(exc: RequestValidationError) -> str:
    msgs = []
    for e in exc.errors():
        msg = str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        msgs.append(f"{_loc(tuple(e.get('loc', ())))}: {msg}")
    return "; ".join(msgs)


def _name(name: str) -> str:
    try:
        return validate_name(name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def parse_task_id(task_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(task_id)
    except ValueError:
        raise InvalidRequest(f"{task_id!r} is not a task id; task ids are UUIDs like 3f2a…") from None


def create_app(store: Store, scheduler: Scheduler) -> FastAPI:
    app = FastAPI(
        title="Podium",
        version=__version__,
        description="A control plane that runs work on a fleet of machines and tells the truth about it.",
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    @app.exception_handler(InvalidRequest)
    async def _bad(_r: Request, exc: InvalidRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=422)

    @app.exception_handler(NotFound)
    async def _nf(_r: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    async def _cf(_r: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=409)

    @app.exception_handler(StoreUnavailable)
    async def _su(_r: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"error": f"{exc}; retry (with the same idempotency key for a submit)"}, status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return JSONResponse({"error": f"the request body is larger than {MAX_BODY} bytes"}, status_code=413)
        return await call_next(request)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/tasks", response_model=SubmitResponse, status_code=201, responses=_ERRORS)
    async def submit(body: SubmitRequest) -> Any:
        """Submit a task. With an `idempotency_key` already used, returns that task (200) instead."""
        row, created = await store.submit(body.task_spec(), idempotency_key=body.idempotency_key, actor="api")
        resp = SubmitResponse(task=task_out(row), created=created)
        return JSONResponse(json.loads(resp.model_dump_json()), status_code=201 if created else 200)

    @app.get("/v1/tasks", response_model=list[TaskOut], responses=_ERRORS)
    async def list_tasks(
        state: Annotated[TaskState | None, Query(description="only tasks in this state")] = None,
        node: Annotated[str | None, Query(max_length=128)] = None,
        name: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[TaskOut]:
        rows = await store.list_tasks(state=state.value if state else None, node_id=node, name=name, limit=limit)
        return [task_out(r) for r in rows]

    @app.get("/v1/tasks/{task_id}", response_model=TaskDetail, responses=_ERRORS)
    async def get_task(task_id: str) -> TaskDetail:
        task, attempts, events = await store.task_detail(parse_task_id(task_id))
        return TaskDetail(
            **task_out(task).model_dump(), attempt_list=[attempt_out(a) for a in attempts], events=[event_out(e) for e in events]
        )

    @app.post("/v1/tasks/{task_id}/cancel", response_model=TaskOut, responses=_ERRORS)
    async def cancel(task_id: str) -> TaskOut:
        """Cancel a task: a queued one ends at once, one on a node is stopped there (SIGTERM, then
        SIGKILL after the grace); a task already ended is returned unchanged."""
        return task_out(await scheduler.cancel(parse_task_id(task_id), actor="api"))

    @app.get("/v1/tasks/{task_id}/logs", response_model=LogsOut, responses=_ERRORS)
    async def logs(
        task_id: str,
        after: Annotated[int, Query(ge=0, description="return chunks after this id")] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        follow: Annotated[bool, Query(description="stream NDJSON until the task ends")] = False,
    ) -> Any:
        tid = parse_task_id(task_id)
        task = await store.get_task(tid)
        if not follow:
            rows = await store.read_logs(tid, after, limit)
            return LogsOut(
                chunks=[_chunk(r) for r in rows],
                next_after=rows[-1]["id"] if rows else after,
                task_state=task["state"],
                terminal=TaskState(task["state"]) in TERMINAL,
            )
        return StreamingResponse(_follow(store, tid, after), media_type="application/x-ndjson")

    @app.get("/v1/tasks/{task_id}/explain", response_model=ExplainOut, responses=_ERRORS)
    async def explain(task_id: str) -> ExplainOut:
        """Why is my task still queued? Every node with the first check it fails, or its score."""
        task, verdicts, avoid = await scheduler.explain(parse_task_id(task_id))
        return ExplainOut(
            task_id=task["id"], state=task["state"], reason=task["reason"], node_id=task["node_id"],
            nodes=[VerdictOut(node_id=v.node_id, name=row["name"] if row else v.node_id, fits=v.failed is None,
                              failed=v.failed, score=v.score, avoided=v.node_id in avoid) for v, row in verdicts],
        )  # fmt: skip

    @app.put("/v1/specs/{name}", response_model=NamedSpecOut, status_code=201, responses=_ERRORS)
    async def put_spec(name: str, body: TaskSpec) -> NamedSpecOut:
        """Store a new revision of a named spec."""
        return named_spec_out(await store.put_named_spec(_name(name), body, actor="api"))

    @app.get("/v1/specs", response_model=list[NamedSpecOut], responses=_ERRORS)
    async def list_specs() -> list[NamedSpecOut]:
        return [named_spec_out(r) for r in await store.list_named_specs()]

    @app.get("/v1/specs/{name}", response_model=NamedSpecOut, responses=_ERRORS)
    async def get_spec(name: str, revision: Annotated[int | None, Query(ge=1)] = None) -> NamedSpecOut:
        return named_spec_out(await store.named_spec(_name(name), revision))

    @app.post("/v1/specs/{name}/submit", response_model=SubmitResponse, status_code=201, responses=_ERRORS)
    async def submit_spec(name: str, body: SubmitNamedIn) -> Any:
        """Submit the named spec. With `revision`, refused (409) unless that is still the current one."""
        row, created = await store.submit_named(_name(name), body.revision, idempotency_key=body.idempotency_key, actor="api")
        resp = SubmitResponse(task=task_out(row), created=created)
        return JSONResponse(json.loads(resp.model_dump_json()), status_code=201 if created else 200)

    @app.get("/v1/nodes", response_model=list[NodeOut], responses=_ERRORS)
    async def list_nodes() -> list[NodeOut]:
        return [node_out(r) for r in await store.list_nodes()]

    @app.get("/v1/nodes/{node}", response_model=NodeOut, responses=_ERRORS)
    async def get_node(node: str) -> NodeOut:
        return node_out(await store.get_node(node))

    @app.post("/v1/nodes/{node}/drain", response_model=NodeOut, responses=_ERRORS)
    async def drain(node: str) -> NodeOut:
        """Take no new work on this node; what it runs finishes."""
        row = await store.get_node(node)
        await store.set_draining(row["id"], True)
        return node_out(await store.get_node(row["id"]))

    @app.put("/v1/nodes/{node}/labels", response_model=NodeOut, responses=_ERRORS)
    async def set_labels(node: str, body: LabelsIn) -> NodeOut:
        """Replace a node's labels. From then on the operator's labels win over what the agent reports."""
        row = await store.get_node(node)
        await store.set_labels(row["id"], body.labels)
        return node_out(await store.get_node(row["id"]))

    @app.post("/v1/nodes/{node}/undrain", response_model=NodeOut, responses=_ERRORS)
    async def undrain(node: str) -> NodeOut:
        row = await store.get_node(node)
        await store.set_draining(row["id"], False)
        return node_out(await store.get_node(row["id"]))

    return app


def _chunk(r: Any) -> LogChunkOut:
    return LogChunkOut(
        id=r["id"], attempt=r["attempt"], fencing_token=r["fencing_token"], stream=r["stream"],
        data=bytes(r["data"]).decode("utf-8", errors="replace"),
    )  # fmt: skip


async def _follow(store: Store, tid: uuid.UUID, after: int) -> AsyncIterator[bytes]:
    """NDJSON: {"chunk": …} lines as output arrives, then one {"end": {state, exit_code, reason}}.
    The end is sent only after a read following the terminal state found nothing new, so no output
    written before the end is missed."""
    while True:
        try:
            task = await store.get_task(tid)
            rows = await store.read_logs(tid, after, 1000)
        except StoreUnavailable:
            await asyncio.sleep(1)
            continue
        for r in rows:
            after = r["id"]
            yield (json.dumps({"chunk": _chunk(r).model_dump()}) + "\n").encode()
        if not rows and TaskState(task["state"]) in TERMINAL:
            # the gateway stores an attempt's output before its end; one more read closes the gap
            # between the two reads above
            rows = await store.read_logs(tid, after, 1000)
            for r in rows:
                after = r["id"]
                yield (json.dumps({"chunk": _chunk(r).model_dump()}) + "\n").encode()
            if not rows:
                end = {"state": task["state"], "exit_code": task["exit_code"], "reason": task["reason"]}
                yield (json.dumps({"end": end}) + "\n").encode()
                return
        elif not rows:
            await asyncio.sleep(FOLLOW_POLL)
