"""The REST API. Every handler validates its input before touching the store, so bad input gets a
4xx that names the field and the problem and changes nothing; a database that is away is a 503,
never a 500."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from podium import __version__, reasons
from podium.api.guard import RequestGuard
from podium.api.ui import install as install_ui
from podium.api.models import (
    AuditOut, BatchIn, CheckOut, ErrorOut, EventOut, ExplainOut, LabelsIn, RegistryLoginIn, SecretIn, SecretOut, TokenCreated, TokenIn, TokenOut, LogChunkOut, LogsOut, NamedSpecOut, NodeEventOut, NodeOut, SubmitNamedIn, SubmitResponse,
    TaskDetail, TaskOut, VerdictOut, attempt_out, event_out, named_spec_out, node_out, task_out,
)  # fmt: skip
from podium.errors import Ambiguous, Conflict, Contention, Forbidden, InvalidRequest, NotFound, Overloaded, PreconditionFailed, ProfileRevisionMismatch, StoreUnavailable, Unauthorized
from podium.pressure import Pressure
from podium.security.service import REGISTRY_PREFIX, Principal, Security, validate_registry_host
from podium.security.tokens import Role
from podium.scheduler.service import Scheduler
from podium.spec import SubmitRequest, TaskSpec, validate_name
from podium.states import TERMINAL, TaskState
from podium.store import Store
from podium.units import parse_duration

FOLLOW_POLL = 0.1  # seconds between reads while following logs
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (400, 401, 403, 404, 409, 413, 422, 503)
}
# A submission whose idempotency key was used before answers 200 with the task that key made.
_SUBMIT = {
    **_ERRORS,
    200: {"model": SubmitResponse, "description": "the task an earlier submission with this idempotency key made"},
    429: {"model": ErrorOut, "description": "the server is overloaded and stored nothing; retry after Retry-After seconds"},
}
_SUBMIT_BATCH = {**_ERRORS, 429: _SUBMIT[429]}


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def _validation_message(exc: RequestValidationError) -> str:
    msgs = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'cannot be parsed')})"
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


# ---- paging: the convention every list endpoint follows (docs/decisions.md, "Paging") ----------
#
# `?limit=N` rows, newest (or first) first in a stable order; when more follow, the answer carries
# `Link: <same path and filters, after=CURSOR>; rel="next"`. The cursor is opaque (base64url JSON of
# the last row's sort key, tagged with its listing) and good for as long as the rows exist: paging
# is a keyset range scan from it, never OFFSET, so page 1,000 costs what page 1 does. `count=true`
# adds `Podium-Remaining`: how many rows follow the page, counted up to REMAINING_CAP ("10000+" past it).
REMAINING_CAP = 10_000
_AFTER_DOC = "the cursor from the previous page's `Link: rel=\"next\"` header; omit it for the first page"
_COUNT_DOC = f"add a `Podium-Remaining` header: how many rows follow this page (up to {REMAINING_CAP:,}, then `{REMAINING_CAP}+`)"
_PAGE_HEADERS = {
    "Link": {"description": 'the next page, `<URL>; rel="next"`; absent on the last page', "schema": {"type": "string"}},
    "Podium-Remaining": {"description": "with count=true: how many rows follow this page", "schema": {"type": "string"}},
}


def _cursor(kind: str, *key: Any) -> str:
    raw = json.dumps([kind, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _uncursor(kind: str, cursor: str | None, types: tuple[type, ...]) -> list[Any] | None:
    """The sort key a cursor holds, or a 422 naming `after` if it is not one this listing gave out."""
    if cursor is None:
        return None
    bad = InvalidRequest(
        f"after: {cursor[:80]!r} is not a cursor of this listing; pass the one from the previous page's "
        'Link: rel="next" header, or omit `after` for the first page'
    )
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(key, list) or len(key) != len(types) + 1 or key[0] != kind:
        raise bad
    out: list[Any] = []
    try:
        for value, typ in zip(key[1:], types, strict=True):
            if typ is int:
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                    raise ValueError
                out.append(value)
            elif not isinstance(value, str) or len(value) > 256 or "\x00" in value:
                raise ValueError
            else:
                value.encode()  # a lone surrogate is no key of ours (UnicodeEncodeError is a ValueError)
                if typ is datetime:
                    at = datetime.fromisoformat(value)
                    if at.tzinfo is None:
                        raise ValueError
                    out.append(at)
                elif typ is uuid.UUID:
                    out.append(uuid.UUID(value))
                else:
                    out.append(value)
    except (ValueError, OverflowError):
        raise bad from None
    return out


def _page(request: Request, response: Response, rows: list[Any], limit: int, key: Any, remaining: int | None) -> list[Any]:
    """Trim the one row read beyond `limit` and, if there was one, point `Link` at the next page."""
    if len(rows) > limit:
        rows = rows[:limit]
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("after", "limit")]
        params += [("limit", str(limit)), ("after", key(rows[-1]))]
        response.headers["Link"] = f'<{request.url.path}?{urlencode(params)}>; rel="next"'
    if remaining is not None:
        response.headers["Podium-Remaining"] = f"{REMAINING_CAP}+" if remaining >= REMAINING_CAP else str(remaining)
    return rows


# An id prefix as git and docker take them: hex digits (a uuid's dashes allowed), at most a whole uuid.
_UUID_PREFIX = re.compile(r"^[0-9a-fA-F][0-9a-fA-F-]{0,35}$")


# Podium's errors and the HTTP status each one is; the message is the exception's own sentence.
_STATUS: dict[type[Exception], int] = {
    InvalidRequest: 422, NotFound: 404, Conflict: 409, Unauthorized: 401, Forbidden: 403, PreconditionFailed: 412,
    ProfileRevisionMismatch: 409,
}

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


def _revision_of(if_match: str | None) -> int | None:
    """An If-Match header's revision: `3`, `"3"` or `W/"3"`; `*` (or none) means any."""
    if if_match is None or if_match.strip() == "*":
        return None
    value = if_match.strip().removeprefix("W/").strip('"')
    if not value.isdigit() or len(value) > 18:
        raise InvalidRequest(f"If-Match: {if_match[:40]!r} is not a revision; send the revision (the ETag), e.g. If-Match: \"3\"")
    return int(value)


def create_app(store: Store, scheduler: Scheduler, security: Security, pressure: Pressure | None = None) -> FastAPI:
    app = FastAPI(
        title="Podium",
        version=__version__,
        description="A control plane that runs work on a fleet of machines and tells the truth about it.",
        docs_url=None,  # served from vendored assets by podium.api.ui (works without the internet)
        redoc_url=None,
    )

    app.state.security = security
    admission = pressure or Pressure()

    async def audit(who: Principal, action: str, target: str | None, **detail: Any) -> None:
        await store.audit(who.actor, action, target, detail)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    async def _podium_error(_r: Request, exc: Exception) -> JSONResponse:
        status = _STATUS[type(exc)]
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": str(exc)}, status_code=status, headers=headers)

    for exc_type in _STATUS:
        app.add_exception_handler(exc_type, _podium_error)

    @app.exception_handler(Ambiguous)
    async def _ambiguous(_r: Request, exc: Ambiguous) -> JSONResponse:
        return JSONResponse({"error": str(exc), "candidates": exc.candidates}, status_code=409)

    async def task_ref(ref: str) -> uuid.UUID:
        """A task id, or a unique prefix of one (resolved by a range scan of the primary key)."""
        try:
            return uuid.UUID(ref)
        except ValueError:
            pass
        if not _UUID_PREFIX.match(ref) or len(ref.replace("-", "")) > 32:
            raise InvalidRequest(f"{ref[:80]!r} is not a task id; task ids are UUIDs like 3f2a…, or a unique start of one")
        return await store.resolve_task(ref)

    @app.exception_handler(StoreUnavailable)
    async def _su(_r: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"error": f"{exc}; retry (with the same idempotency key for a submit)"}, status_code=503)

    @app.exception_handler(Contention)
    async def _contention(_r: Request, exc: Contention) -> JSONResponse:
        # Contention passes: a 503 with Retry-After, never a 404 or a 500.
        return JSONResponse(
            {"error": f"{exc}; retry (with the same idempotency key for a submit)"},
            status_code=503,
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(Overloaded)
    async def _overloaded(_r: Request, exc: Overloaded) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    app.add_middleware(RequestGuard)  # type: ignore[arg-type]

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={c: {"model": ErrorOut, "content": {"application/json": {}}} for c in (401, 403, 503)},
    )
    async def metrics(_who: Viewer) -> PlainTextResponse:
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/tasks", response_model=SubmitResponse, status_code=201, responses=_SUBMIT)
    async def submit(body: SubmitRequest, who: Operator) -> Any:
        """Submit a task. With an `idempotency_key` already used, returns that task (200) instead."""
        missing = await security.missing_secrets([r.name for r in body.secrets]) if body.secrets else []
        if missing:
            raise InvalidRequest(
                f"secrets: {', '.join(repr(m) for m in missing)} do{'es' if len(missing) == 1 else ''} not exist; "
                "create them with `podium secret set NAME` first"
            )
        admission.admit()
        row, created = await store.submit(body.task_spec(), idempotency_key=body.idempotency_key, actor=who.actor)
        resp = SubmitResponse(task=task_out(row), created=created)
        return JSONResponse(json.loads(resp.model_dump_json()), status_code=201 if created else 200)

    @app.post("/v1/tasks/check", response_model=CheckOut, responses=_ERRORS)
    async def check(body: SubmitRequest, _who: Viewer) -> CheckOut:
        """Dry run: could any node of the fleet ever run this spec, and why not each node (hard
        compatibility only, ignoring what is free, connected or draining now). Stores nothing."""
        spec = body.task_spec()
        r = spec.resources
        verdicts = await scheduler.check(json.loads(spec.model_dump_json()), r.cpu, r.memory, r.disk, r.gpus)
        runnable = any(v.failed is None for v, _row in verdicts)
        return CheckOut(
            runnable=runnable, reason=None if runnable else reasons.NO_COMPATIBLE_RUNNER,
            nodes=[VerdictOut(node_id=v.node_id, name=row["name"], fits=v.failed is None, failed=v.failed, score=None,
                              avoided=False, health=row["health"]) for v, row in verdicts],
        )  # fmt: skip

    @app.post("/v1/tasks/batch", response_model=list[SubmitResponse], responses=_SUBMIT_BATCH)
    async def submit_batch(body: BatchIn, who: Operator) -> list[SubmitResponse]:
        """Submit up to 1,000 tasks in one transaction: all are stored, or none (a reused idempotency
        key with a different spec refuses the whole batch). Each answer is what a single submit gives."""
        names = sorted({r.name for t in body.tasks for r in t.secrets})
        missing = await security.missing_secrets(names) if names else []
        if missing:
            raise InvalidRequest(f"secrets: {', '.join(repr(m) for m in missing)} do not exist; create them first")
        admission.admit(len(body.tasks))
        rows = await store.submit_many([(t.task_spec(), t.idempotency_key) for t in body.tasks], actor=who.actor)
        return [SubmitResponse(task=task_out(r), created=c) for r, c in rows]

    @app.get("/v1/tasks", response_model=list[TaskOut], responses={**_ERRORS, 200: {"headers": _PAGE_HEADERS}})
    async def list_tasks(
        _who: Viewer,
        request: Request,
        response: Response,
        state: Annotated[TaskState | None, Query(description="only tasks in this state")] = None,
        node: Annotated[str | None, Query(max_length=128)] = None,
        name: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="tasks per page")] = 100,
        after: Annotated[str | None, Query(max_length=512, description=_AFTER_DOC)] = None,
        count: Annotated[bool, Query(description=_COUNT_DOC)] = False,
    ) -> list[TaskOut]:
        """Tasks, newest first (created_at, then id, descending), one page at a time: follow the
        `Link: <…>; rel="next"` header (absent on the last page) to read the next one."""
        cur = _uncursor("tasks", after, (datetime, uuid.UUID))
        pos = (cur[0], cur[1]) if cur else None
        filters = {"state": state.value if state else None, "node_id": node, "name": name}
        rows = list(await store.list_tasks(**filters, limit=limit + 1, after=pos))
        remaining = None
        if count:
            last = (rows[limit - 1]["created_at"], rows[limit - 1]["id"]) if len(rows) > limit else None
            remaining = await store.count_tasks_after(**filters, after=last, cap=REMAINING_CAP) if last else 0
        rows = _page(request, response, rows, limit, lambda r: _cursor("tasks", r["created_at"].isoformat(), str(r["id"])), remaining)
        last = await store.last_attempt_nodes([r["id"] for r in rows])
        return [task_out(r, last.get(r["id"])) for r in rows]

    @app.get("/v1/tasks/{task_id}", response_model=TaskDetail, responses=_ERRORS)
    async def get_task(task_id: str, _who: Viewer, response: Response) -> TaskDetail:
        task, attempts, events = await store.task_detail(await task_ref(task_id))
        last = (await store.last_attempt_nodes([task["id"]])).get(task["id"])
        response.headers["ETag"] = f'"{task["revision"]}"'
        return TaskDetail(
            **task_out(task, last).model_dump(), attempt_list=[attempt_out(a) for a in attempts], events=[event_out(e) for e in events]
        )

    @app.post("/v1/tasks/{task_id}/cancel", response_model=TaskOut, responses=_ERRORS)
    async def cancel(
        task_id: str,
        who: Operator,
        response: Response,
        if_match: Annotated[str | None, Header(description="the task's revision (its ETag): refuse (412) if it changed since")] = None,
    ) -> TaskOut:
        """Cancel a task: a queued one ends at once, one on a node is stopped there (SIGTERM, then
        SIGKILL after the grace); a task already ended is returned unchanged. With `If-Match`, only
        if the task is still at that revision."""
        tid = await task_ref(task_id)
        row = await scheduler.cancel(tid, actor=who.actor, if_revision=_revision_of(if_match))
        await audit(who, "task.cancel", str(tid), state=row["state"])
        response.headers["ETag"] = f'"{row["revision"]}"'
        return task_out(row)

    @app.get("/v1/tasks/{task_id}/logs", response_model=LogsOut, responses=_ERRORS)
    async def logs(
        task_id: str,
        _who: Viewer,
        after: Annotated[int, Query(ge=0, le=BIGINT_MAX, description="return what comes after the chunk with this id")] = 0,
        cursor: Annotated[str | None, Query(max_length=64, description="return what comes after the chunk with this cursor")] = None,
        stream: Annotated[Literal["stdout", "stderr"] | None, Query(description="only this stream")] = None,
        offset: Annotated[int | None, Query(ge=0, le=BIGINT_MAX, description="with `stream`: from this byte of the stream on")] = None,
        attempt: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="only this attempt (with `offset`: the latest by default)")] = None,
        encoding: Annotated[Literal["utf-8", "base64"], Query(description="how `data` carries the bytes")] = "utf-8",
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        follow: Annotated[bool, Query(description="stream NDJSON until the task ends")] = False,
    ) -> Any:
        """A task's output in the order it was written, byte for byte (see LogChunkOut and LogsOut for
        offsets, cursors and resuming)."""
        tid = await task_ref(task_id)
        task = await store.get_task(tid)
        if cursor is not None and after:
            raise InvalidRequest("give either after or cursor, not both; cursor is the one to use")
        if offset is not None and stream is None:
            raise InvalidRequest("offset is a byte of one stream: give stream=stdout or stream=stderr with it")
        if cursor is not None:
            position: tuple[int, int, str] | None = _parse_log_cursor(cursor)
        elif after:
            position = await store.log_position(tid, after)
            if position is None:
                raise InvalidRequest(f"after={after} is no chunk of this task; give the id of a chunk it returned, or 0")
        else:
            position = None
        if offset is not None and attempt is None:
            attempt = task["attempts"] or None  # offsets count within one attempt: the latest one
        read = _LogRead(tid, position, stream, attempt, offset or 0, encoding)
        if not follow:
            rows = await read.page(store, limit)
            return LogsOut(
                chunks=[read.chunk(r) for r in rows],
                next_after=rows[-1]["id"] if rows else after,
                next_cursor=_log_cursor(read.position) if read.position else None,
                task_state=task["state"],
                terminal=TaskState(task["state"]) in TERMINAL,
            )
        return StreamingResponse(_follow(store, read), media_type="application/x-ndjson")

    @app.get("/v1/tasks/{task_id}/explain", response_model=ExplainOut, responses=_ERRORS)
    async def explain(task_id: str, _who: Viewer) -> ExplainOut:
        """Why is my task still queued? Every node with the first check it fails, or its score."""
        task, verdicts, avoid = await scheduler.explain(await task_ref(task_id))
        return ExplainOut(
            task_id=task["id"], state=task["state"], reason=task["reason"], node_id=task["node_id"],
            nodes=[VerdictOut(node_id=v.node_id, name=row["name"] if row else v.node_id, fits=v.failed is None,
                              failed=v.failed, score=v.score, avoided=v.node_id in avoid,
                              health=row["health"] if row else None, holds=list(v.holds)) for v, row in verdicts],
        )  # fmt: skip

    @app.get("/v1/tasks/{task_id}/events", response_model=list[EventOut], responses={**_ERRORS, 200: {"headers": _PAGE_HEADERS}})
    async def task_events(
        task_id: str,
        _who: Viewer,
        request: Request,
        response: Response,
        limit: Annotated[int, Query(ge=1, le=1000, description="events per page")] = 100,
        after: Annotated[str | None, Query(max_length=512, description=_AFTER_DOC)] = None,
    ) -> list[EventOut]:
        """A task's history in the order it happened, one page at a time (see `GET /v1/tasks` for paging)."""
        cur = _uncursor("events", after, (int,))
        rows = list(await store.task_events(await task_ref(task_id), cur[0] if cur else 0, limit + 1))
        rows = _page(request, response, rows, limit, lambda r: _cursor("events", r["id"]), None)
        return [event_out(e) for e in rows]

    @app.put("/v1/specs/{name}", response_model=NamedSpecOut, status_code=201, responses=_ERRORS)
    async def put_spec(name: str, body: TaskSpec, who: Operator) -> NamedSpecOut:
        """Store a new revision of a named spec."""
        row = await store.put_named_spec(_name(name), body, actor=who.actor)
        await audit(who, "spec.put", name, revision=row["revision"])
        return named_spec_out(row)

    @app.get("/v1/specs", response_model=list[NamedSpecOut], responses=_ERRORS)
    async def list_specs(_who: Viewer) -> list[NamedSpecOut]:
        return [named_spec_out(r) for r in await store.list_named_specs()]

    @app.get("/v1/specs/{name}", response_model=NamedSpecOut, responses=_ERRORS)
    async def get_spec(name: str, _who: Viewer, revision: Annotated[int | None, Query(ge=1)] = None) -> NamedSpecOut:
        return named_spec_out(await store.named_spec(_name(name), revision))

    @app.post("/v1/specs/{name}/submit", response_model=SubmitResponse, status_code=201, responses=_SUBMIT)
    async def submit_spec(name: str, body: SubmitNamedIn, who: Operator) -> Any:
        """Submit the named spec. With `revision`, refused (409) unless that is still the current one."""
        admission.admit()
        row, created = await store.submit_named(_name(name), body.revision, idempotency_key=body.idempotency_key, actor=who.actor)
        resp = SubmitResponse(task=task_out(row), created=created)
        return JSONResponse(json.loads(resp.model_dump_json()), status_code=201 if created else 200)

    @app.get("/v1/nodes", response_model=list[NodeOut], responses={**_ERRORS, 200: {"headers": _PAGE_HEADERS}})
    async def list_nodes(
        _who: Viewer,
        request: Request,
        response: Response,
        limit: Annotated[int, Query(ge=1, le=1000, description="nodes per page")] = 1000,
        after: Annotated[str | None, Query(max_length=512, description=_AFTER_DOC)] = None,
        count: Annotated[bool, Query(description=_COUNT_DOC)] = False,
    ) -> list[NodeOut]:
        """Nodes by name (then id), one page at a time (see `GET /v1/tasks` for paging)."""
        cur = _uncursor("nodes", after, (str, str))
        pos = (cur[0], cur[1]) if cur else None
        rows = list(await store.list_nodes_page(limit=limit + 1, after=pos))
        remaining = None
        if count:
            last = (rows[limit - 1]["name"], rows[limit - 1]["id"]) if len(rows) > limit else None
            remaining = await store.count_nodes_after(after=last, cap=REMAINING_CAP) if last else 0
        rows = _page(request, response, rows, limit, lambda r: _cursor("nodes", r["name"], r["id"]), remaining)
        releasing = await store.nodes_releasing([r["id"] for r in rows])
        return [node_out(r, releasing.get(r["id"])) for r in rows]

    @app.get("/v1/nodes/{node}", response_model=NodeOut, responses=_ERRORS)
    async def get_node(node: str, _who: Viewer, response: Response) -> NodeOut:
        out = await _node(node)
        response.headers["ETag"] = f'"{out.revision}"'
        return out

    async def _node(node: str) -> NodeOut:
        """A node as the API shows it, with the capacity it still holds for sandboxes being removed."""
        row = await store.get_node(node)
        return node_out(row, (await store.nodes_releasing([row["id"]])).get(row["id"]))

    @app.get("/v1/nodes/{node}/events", response_model=list[NodeEventOut], responses=_ERRORS)
    async def node_events(
        node: str, _who: Viewer, after: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 1000
    ) -> list[NodeEventOut]:
        """The node's history, oldest first: agent instances superseded, attempts handed over. Page
        with `after` = the last id seen."""
        row = await store.get_node(node)
        return [NodeEventOut(**dict(r)) for r in await store.node_events(row["id"], after, limit)]

    @app.post("/v1/nodes/{node}/drain", response_model=NodeOut, responses=_ERRORS)
    async def drain(
        node: str,
        who: Operator,
        deadline: Annotated[str | None, Query(description="e.g. 10m: past it, what still runs there is requeued or lost by its node-loss policy")] = None,
    ) -> NodeOut:
        """Take no new work on this node; what it runs finishes (or, past `deadline`, goes through
        its node-loss policy). `drain_phase` says when it is drained: nothing left, safe to power off."""
        seconds = None
        if deadline is not None:
            try:
                seconds = parse_duration(deadline)
            except ValueError as e:
                raise InvalidRequest(f"deadline: {e}") from None
            if seconds < 0:
                raise InvalidRequest("deadline: must not be negative (e.g. 10m)")
        row = await store.get_node(node)
        await store.set_draining(row["id"], True, seconds)
        await audit(who, "node.drain", row["id"], deadline=seconds)
        return await _node(row["id"])

    @app.put("/v1/nodes/{node}/labels", response_model=NodeOut, responses=_ERRORS)
    async def set_labels(
        node: str,
        body: LabelsIn,
        who: Operator,
        response: Response,
        if_match: Annotated[str | None, Header(description="the node's revision (its ETag): refuse (412) if it changed since")] = None,
    ) -> NodeOut:
        """Replace a node's labels. From then on the operator's labels win over what the agent reports.
        With `If-Match`, only if the node is still at that revision."""
        row = await store.get_node(node)
        await store.set_labels(row["id"], body.labels, _revision_of(if_match))
        await audit(who, "node.labels", row["id"], labels=body.labels)
        out = await _node(row["id"])
        response.headers["ETag"] = f'"{out.revision}"'
        return out

    @app.post("/v1/nodes/{node}/undrain", response_model=NodeOut, responses=_ERRORS)
    async def undrain(node: str, who: Operator) -> NodeOut:
        row = await store.get_node(node)
        await store.set_draining(row["id"], False)
        await audit(who, "node.undrain", row["id"])
        return await _node(row["id"])

    # ---- identities, secrets, audit ----------------------------------------------------------

    @app.post("/v1/tokens", response_model=TokenCreated, status_code=201, responses=_ERRORS)
    async def create_token(body: TokenIn, who: Admin) -> TokenCreated:
        """Create a token. Its value is in this answer and nowhere else, ever."""
        row, token = await security.create_token(body.name, body.role, by=who.actor)
        await audit(who, "token.create", row["id"], name=body.name, role=body.role)
        return TokenCreated(**_token_fields(row), token=token)

    @app.get("/v1/tokens", response_model=list[TokenOut], responses=_ERRORS)
    async def list_tokens(_who: Admin) -> list[TokenOut]:
        return [TokenOut(**_token_fields(r)) for r in await store.list_tokens()]

    @app.delete("/v1/tokens/{token_id}", response_model=TokenOut, responses=_ERRORS)
    async def revoke_token(token_id: str, who: Admin) -> TokenOut:
        """Revoke a token; it stops working at once."""
        if len(token_id) > 64:
            raise InvalidRequest("a token id is at most 64 characters")
        row = await store.revoke_token(token_id)
        await audit(who, "token.revoke", row["id"])
        return TokenOut(**_token_fields(row))

    @app.put("/v1/secrets/{name}", response_model=SecretOut, status_code=201, responses=_ERRORS)
    async def set_secret(name: str, body: SecretIn, who: Admin) -> SecretOut:
        """Create or replace a secret. The value is encrypted at rest and never returned."""
        row = await security.set_secret(_name(name), body.value.encode(), who.actor)
        await audit(who, "secret.set", name, version=row["version"])
        return SecretOut(**row)

    @app.get("/v1/secrets", response_model=list[SecretOut], responses=_ERRORS)
    async def list_secrets(_who: Operator) -> list[SecretOut]:
        """Names, versions and times; never values."""
        return [SecretOut(**dict(r)) for r in await store.list_secrets()]

    @app.delete("/v1/secrets/{name}", status_code=204, responses=_ERRORS)
    async def delete_secret(name: str, who: Admin) -> Response:
        await store.delete_secret(name if name.startswith(REGISTRY_PREFIX) else _name(name))
        await audit(who, "secret.delete", name)
        return Response(status_code=204)

    @app.put("/v1/registries/{host}", response_model=SecretOut, status_code=201, responses=_ERRORS)
    async def registry_login(host: str, body: RegistryLoginIn, who: Admin) -> SecretOut:
        """Store a registry login; it is sent only with tasks whose image comes from that registry."""
        name = REGISTRY_PREFIX + validate_registry_host(host)
        value = json.dumps({"username": body.username, "password": body.password}).encode()
        row = await security.set_secret(name, value, who.actor)
        await audit(who, "registry.login", host, username=body.username)
        return SecretOut(**row)

    @app.post("/v1/nodes/{node}/revoke", response_model=NodeOut, responses=_ERRORS)
    async def revoke_node(node: str, who: Admin) -> NodeOut:
        """Remove a node from the fleet: its stream is closed, it can never rejoin, and its tasks go
        through the node-loss policy."""
        row = await store.get_node(node)
        await store.revoke_node(row["id"])
        await scheduler.node_removed(row["id"])
        await audit(who, "node.revoke", row["id"])
        return await _node(row["id"])

    @app.get("/v1/audit", response_model=list[AuditOut], responses={**_ERRORS, 200: {"headers": _PAGE_HEADERS}})
    async def read_audit(
        _who: Admin,
        request: Request,
        response: Response,
        limit: Annotated[int, Query(ge=1, le=10000, description="entries per page")] = 100,
        after: Annotated[str | None, Query(max_length=512, description=_AFTER_DOC)] = None,
        count: Annotated[bool, Query(description=_COUNT_DOC)] = False,
    ) -> list[AuditOut]:
        """Who did what, newest first, one page at a time (see `GET /v1/tasks` for paging)."""
        cur = _uncursor("audit", after, (int,))
        rows = list(await store.read_audit(limit + 1, cur[0] if cur else None))
        remaining = None
        if count:
            remaining = await store.count_audit_after(rows[limit - 1]["id"], REMAINING_CAP) if len(rows) > limit else 0
        rows = _page(request, response, rows, limit, lambda r: _cursor("audit", r["id"]), remaining)
        return [AuditOut(**dict(r)) for r in rows]

    install_ui(app, store, scheduler, security)  # the event stream, the web UI, /docs
    return app


def _token_fields(r: Any) -> dict[str, Any]:
    return {k: r[k] for k in ("id", "name", "role", "created_at", "created_by", "revoked_at")}


BIGINT_MAX = 2**63 - 1
_CURSOR = re.compile(r"^(\d{1,19})\.(\d{1,19})\.(stdout|stderr)$")


def _log_cursor(position: tuple[int, int, str]) -> str:
    return "{}.{}.{}".format(*position)


def _parse_log_cursor(text: str) -> tuple[int, int, str]:
    m = _CURSOR.match(text)
    if m is None or int(m[1]) > BIGINT_MAX or int(m[2]) > BIGINT_MAX:
        raise InvalidRequest(f"cursor {text!r} is not one this server gave; use a chunk's cursor or next_cursor as returned")
    return int(m[1]), int(m[2]), m[3]


class _LogRead:
    """One reader's place in a task's output: the position of the last chunk it was given, and its
    filters. Reading moves the position on, so a follower never sees a chunk twice."""

    def __init__(self, tid: uuid.UUID, position: tuple[int, int, str] | None, stream: str | None,
                 attempt: int | None, offset: int, encoding: str) -> None:  # fmt: skip
        self.tid = tid
        self.position = position
        self.stream = stream
        self.attempt = attempt
        self.offset = offset
        self.encoding = encoding

    async def page(self, store: Store, limit: int) -> list[Any]:
        rows = await store.read_logs(self.tid, after=self.position, stream=self.stream, attempt=self.attempt,
                                     offset=self.offset, limit=limit)  # fmt: skip
        if rows:
            last = rows[-1]
            self.position = (last["fencing_token"], last["seq"], last["stream"])
        return rows

    def chunk(self, r: Any) -> LogChunkOut:
        data, offset = bytes(r["data"]), r["byte_offset"]
        if offset < self.offset:  # the chunk holding the byte asked for: from that byte on
            data, offset = data[self.offset - offset :], self.offset
        return LogChunkOut(
            id=r["id"], attempt=r["attempt"], fencing_token=r["fencing_token"], stream=r["stream"], seq=r["seq"],
            offset=offset, length=len(data), cursor=_log_cursor((r["fencing_token"], r["seq"], r["stream"])),
            data=base64.b64encode(data).decode() if self.encoding == "base64" else data.decode("utf-8", errors="replace"),
        )  # fmt: skip


async def _follow(store: Store, read: _LogRead) -> AsyncIterator[bytes]:
    """NDJSON: {"chunk": …} lines as output arrives, then one {"end": {state, exit_code, reason}}.
    The end is sent only after a read following the terminal state found nothing new, so no output
    written before the end is missed."""
    while True:
        try:
            task = await store.get_task(read.tid)
            rows = await read.page(store, 1000)
        except StoreUnavailable:
            await asyncio.sleep(1)
            continue
        for r in rows:
            yield (json.dumps({"chunk": read.chunk(r).model_dump()}) + "\n").encode()
        if not rows and TaskState(task["state"]) in TERMINAL:
            # the gateway stores an attempt's output before its end; one more read closes the gap
            # between the two reads above
            try:
                rows = await read.page(store, 1000)
            except StoreUnavailable:
                await asyncio.sleep(1)
                continue
            for r in rows:
                yield (json.dumps({"chunk": read.chunk(r).model_dump()}) + "\n").encode()
            if not rows:
                end = {"state": task["state"], "exit_code": task["exit_code"], "reason": task["reason"]}
                yield (json.dumps({"end": end}) + "\n").encode()
                return
        elif not rows:
            await asyncio.sleep(FOLLOW_POLL)
