"""The UI's pages and form actions. Every page is rendered by an autoescaping Jinja2 environment
and sent with a strict Content-Security-Policy (scripts and styles from this server only, no inline
script). Every POST checks the session's CSRF token before anything else; a POST without it changes
nothing. Role checks are the API's: a viewer is shown no buttons and refused if it posts anyway."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import ValidationError

from podium.api import events
from podium.api.session import COOKIE, SESSION_SECONDS, SignedOut, csrf_ok
from podium.errors import Conflict, Forbidden, InvalidRequest, NotFound, StoreUnavailable, Unauthorized
from podium.security.service import REGISTRY_PREFIX, Principal
from podium.security.tokens import Role, allows
from podium.spec import TaskSpec, validate_name
from podium.states import TERMINAL, TaskState
from podium.store import Store
from podium.store.rows import LogChunkRow, StreamEventRow, TaskRow
from podium.store.ui import Cursor

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
PRE_COOKIE = "podium_signin"  # the sign-in form's own CSRF token (double-submit: no session yet)
PAGE_SIZE = 50
MAX_FORM = 256 * 1024

env = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(["html"], default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _ago(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else ""


def _mem(n: int | None) -> str:
    if not n:
        return "0"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


env.filters["when"] = _ago
env.filters["mem"] = _mem
env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)


def page(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    html = env.get_template(template).render(request=request, **ctx)
    return HTMLResponse(html, status_code=status, headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})


def fragment(template: str, **ctx: Any) -> str:
    return env.get_template(template).render(**ctx)


class Who:
    """The signed-in principal and what the page may offer it."""

    def __init__(self, principal: Principal, csrf: str) -> None:
        self.principal = principal
        self.csrf = csrf
        self.name = principal.name
        self.role = principal.role
        self.operator = allows(principal.role, Role.OPERATOR)
        self.admin = allows(principal.role, Role.ADMIN)


async def _who(request: Request) -> Who:
    found = await request.app.state.sessions.session(request)
    if found is None:
        raise SignedOut()
    return Who(*found)


async def _form(request: Request) -> dict[str, str]:
    body = await request.body()
    if len(body) > MAX_FORM:
        raise InvalidRequest("the form is too large")
    try:
        parsed = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise InvalidRequest("the form is not valid UTF-8") from None
    return {k: v[0] for k, v in parsed.items()}


async def _post(request: Request, needed: Role) -> tuple[Who, dict[str, str]]:
    """A state-changing form: signed in, the session's CSRF token, the role. In that order, and
    before anything is read from the form or changed."""
    who = await _who(request)
    form = await _form(request)
    if not csrf_ok(who.csrf, form.get("csrf")):
        raise Forbidden("this form is missing its CSRF token or it is stale; reload the page and try again")
    if not allows(who.role, needed):
        raise Forbidden(f"a {who.role} token may not do this; it needs the {needed} role")
    return who, form


def _back(url: str, note: str | None = None) -> RedirectResponse:
    if note:
        url += ("&" if "?" in url else "?") + urlencode({"note": note})
    return RedirectResponse(url, status_code=303)


async def _stream_from(request: Request) -> str:
    """The event-stream position a page was rendered at, so its live stream misses nothing since."""
    hub: events.EventHub = request.app.state.event_hub
    await hub.ensure_started()
    head = hub.head or Cursor(0, 0)
    return f"{head.txid}-{head.id}"


def _parse_from(raw: str | None) -> Cursor | None:
    if not raw:
        return None
    try:
        txid, _, eid = raw.partition("-")
        return Cursor(int(txid), int(eid))
    except ValueError:
        raise InvalidRequest(f"from: {raw!r} is not a stream position") from None


def _labels(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in raw.replace("\n", ",").split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            raise InvalidRequest(f"labels: {part!r} is not KEY=VALUE; write them like zone=a, gpu=a100")
        out[k.strip()] = v.strip()
    return out


def _uuid(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(f"{raw!r} is not a task id") from None


def router() -> APIRouter:
    r = APIRouter(include_in_schema=False)

    # ---- sign-in ---------------------------------------------------------------------------

    @r.get("/signin")
    async def signin_form(request: Request, note: str | None = None) -> HTMLResponse:
        token = secrets.token_urlsafe(24)
        resp = page(request, "signin.html", csrf=token, note=note, who=None)
        resp.set_cookie(PRE_COOKIE, token, httponly=True, samesite="strict", path="/signin", max_age=3600)
        return resp

    @r.post("/signin")
    async def signin(request: Request) -> Response:
        form = await _form(request)
        if not csrf_ok(request.cookies.get(PRE_COOKIE, ""), form.get("csrf")):
            raise Forbidden("the sign-in form is missing its CSRF token; reload the page and try again")
        try:
            cookie, _principal = await request.app.state.sessions.sign_in(form.get("token", ""))
        except (Unauthorized, Forbidden) as e:
            return _back("/signin", str(e))
        resp = _back("/")
        resp.set_cookie(COOKIE, cookie, httponly=True, samesite="strict", path="/", max_age=int(SESSION_SECONDS),
                        secure=request.url.scheme == "https")  # fmt: skip
        resp.delete_cookie(PRE_COOKIE, path="/signin")
        return resp

    @r.post("/signout")
    async def signout(request: Request) -> Response:
        await _post(request, Role.VIEWER)
        await request.app.state.sessions.sign_out(request.cookies.get(COOKIE))
        resp = _back("/signin", "signed out")
        resp.delete_cookie(COOKIE, path="/")
        return resp

    # ---- tasks -----------------------------------------------------------------------------

    @r.get("/")
    async def tasks(
        request: Request, state: str = "", name: str = "", node: str = "", label: str = "", before: str = "",
        note: str | None = None,
    ) -> HTMLResponse:  # fmt: skip
        who = await _who(request)
        store: Store = request.app.state.store
        errors = []
        state_v = state if state in {s.value for s in TaskState} else None
        if state and not state_v:
            errors.append(f"state: {state!r} is not a task state")
        node_id = None
        if node:
            try:
                node_id = (await store.get_node(node)).id
            except NotFound:
                errors.append(f"node: no node {node!r}")
                node_id = "\x01none"  # matches nothing
        labels = None
        if label:
            try:
                labels = _labels(label)
            except InvalidRequest as e:
                errors.append(str(e))
        cursor = None
        if before:
            at, _, tid = before.partition("_")
            try:
                cursor = (datetime.fromisoformat(at), uuid.UUID(tid))
            except ValueError:
                errors.append("before: not a page position; use the Next link")
        stream_from = await _stream_from(request)
        rows = await request.app.state.ui_store.tasks_page(
            before=cursor, state=state_v, name=name or None, node_id=node_id, labels=labels, limit=PAGE_SIZE + 1
        )
        more = len(rows) > PAGE_SIZE
        rows = rows[:PAGE_SIZE]
        filters = {k: v for k, v in (("state", state), ("name", name), ("node", node), ("label", label)) if v}
        next_url = None
        if more:
            last = rows[-1]
            next_url = "/?" + urlencode({**filters, "before": f"{last.created_at.isoformat()}_{last.id}"})
        live = None
        if not before and not labels:
            live = "/ui/stream/tasks?" + urlencode({**{k: v for k, v in filters.items() if k != "label"}, "from": stream_from})
        first_url = "/?" + urlencode(filters) if before else None
        return page(request, "tasks.html", who=who, rows=rows, filters=filters, next_url=next_url, live=live, first_url=first_url,
                    errors=errors, states=[s.value for s in TaskState], note=note)  # fmt: skip

    @r.get("/tasks/{task_id}")
    async def task(request: Request, task_id: str, note: str | None = None) -> HTMLResponse:
        who = await _who(request)
        store: Store = request.app.state.store
        tid = _uuid(task_id)
        stream_from = await _stream_from(request)
        row, attempts, evs = await store.task_detail(tid)
        explain = None
        if row.state == TaskState.QUEUED:
            _t, verdicts, avoid = await request.app.state.scheduler.explain(tid)
            explain = [(v, n, v.node_id in avoid) for v, n in verdicts]
        terminal = TaskState(row.state) in TERMINAL
        return page(request, "task.html", who=who, t=row, attempts=attempts, events=evs, explain=explain,
                    terminal=terminal, failure_class=bool(attempts),
                    live="/ui/stream/task/" + str(tid) + "?" + urlencode({"from": stream_from}),
                    logs="/ui/stream/logs/" + str(tid), note=note)  # fmt: skip

    @r.post("/tasks/{task_id}/cancel")
    async def cancel(request: Request, task_id: str) -> Response:
        who, _form_ = await _post(request, Role.OPERATOR)
        tid = _uuid(task_id)
        row = await request.app.state.scheduler.cancel(tid, actor=who.principal.actor)
        await request.app.state.store.audit(who.principal.actor, "task.cancel", str(tid), {"state": row.state, "via": "ui"})
        return _back(f"/tasks/{tid}")

    # ---- nodes -----------------------------------------------------------------------------

    @r.get("/nodes")
    async def nodes(request: Request, note: str | None = None) -> HTMLResponse:
        who = await _who(request)
        store: Store = request.app.state.store
        rows = await store.list_nodes()
        running: dict[str, list[Any]] = {}
        for n in rows:
            if n.revoked_at is None:
                on = await store.list_tasks(node_id=n.id, limit=200)
                running[n.id] = [t for t in on if TaskState(t.state) not in TERMINAL]
        return page(request, "nodes.html", who=who, nodes=rows, running=running, note=note,
                    live="/ui/stream/nodes?" + urlencode({"from": await _stream_from(request)}))  # fmt: skip

    def node_action(action: str, apply: Callable[[Any, str, dict[str, str]], Any]) -> Any:
        async def handler(request: Request, node: str) -> Response:
            who, form = await _post(request, Role.OPERATOR)
            store: Store = request.app.state.store
            row = await store.get_node(node)
            detail = await apply(store, row.id, form)
            await store.audit(who.principal.actor, f"node.{action}", row.id, {**(detail or {}), "via": "ui"})
            return _back("/nodes")

        return handler

    async def _drain(store: Any, node_id: str, _f: dict[str, str]) -> None:
        await store.set_draining(node_id, True)

    async def _undrain(store: Any, node_id: str, _f: dict[str, str]) -> None:
        await store.set_draining(node_id, False)

    async def _label(store: Any, node_id: str, f: dict[str, str]) -> dict[str, Any]:
        labels = _labels(f.get("labels", ""))
        await store.set_labels(node_id, labels)
        return {"labels": labels}

    r.post("/nodes/{node}/drain")(node_action("drain", _drain))
    r.post("/nodes/{node}/undrain")(node_action("undrain", _undrain))
    r.post("/nodes/{node}/labels")(node_action("labels", _label))

    # ---- named specs -----------------------------------------------------------------------

    @r.get("/specs")
    async def specs(request: Request, note: str | None = None) -> HTMLResponse:
        who = await _who(request)
        return page(request, "specs.html", who=who, specs=await request.app.state.store.list_named_specs(), note=note)

    @r.get("/specs/{name}")
    async def spec(request: Request, name: str, note: str | None = None) -> HTMLResponse:
        who = await _who(request)
        revs = await request.app.state.ui_store.spec_revisions(name)
        if not revs:
            raise NotFound(f"no spec named {name!r}")
        return page(request, "spec.html", who=who, name=name, revisions=revs, note=note,
                    draft=json.dumps(revs[0].spec, indent=2, sort_keys=True))  # fmt: skip

    @r.post("/specs/{name}")
    async def put_spec(request: Request, name: str) -> Response:
        who, form = await _post(request, Role.OPERATOR)
        try:
            validate_name(name)
            body = TaskSpec.model_validate(json.loads(form.get("spec", "")))
        except (ValueError, ValidationError) as e:
            return _back(f"/specs/{name}", f"the spec was not stored: {str(e).splitlines()[0]}")
        row = await request.app.state.store.put_named_spec(name, body, actor=who.principal.actor)
        await request.app.state.store.audit(who.principal.actor, "spec.put", name, {"revision": row.revision, "via": "ui"})
        return _back(f"/specs/{name}", f"stored revision {row.revision}")

    @r.post("/specs/{name}/submit")
    async def submit_spec(request: Request, name: str) -> Response:
        who, form = await _post(request, Role.OPERATOR)
        revision = int(form["revision"]) if form.get("revision", "").isdigit() else None
        row, _created = await request.app.state.store.submit_named(name, revision, idempotency_key=None, actor=who.principal.actor)
        return _back(f"/tasks/{row.id}")

    # ---- admin -----------------------------------------------------------------------------

    @r.get("/admin")
    async def admin(request: Request) -> HTMLResponse:
        who = await _who(request)
        if not who.admin:
            raise Forbidden(f"a {who.role} token may not see this page; it needs the admin role")
        store: Store = request.app.state.store
        secrets_ = await store.list_secrets()
        return page(request, "admin.html", who=who, tokens=await store.list_tokens(),
                    secrets=[s for s in secrets_ if not s.name.startswith(REGISTRY_PREFIX)],
                    registries=[s for s in secrets_ if s.name.startswith(REGISTRY_PREFIX)],
                    audit=await store.read_audit(100), prefix=REGISTRY_PREFIX)  # fmt: skip

    # ---- live streams (server-sent HTML fragments for htmx) ------------------------------------

    async def _stream(request: Request, filters: events.Filters, cursor: Cursor | None,
                      render: Callable[[StreamEventRow], str]) -> StreamingResponse:  # fmt: skip
        await _who(request)
        last = request.headers.get("last-event-id")
        if last:
            cursor = await request.app.state.ui_store.cursor_of(int(last)) if last.isdigit() else cursor

        def one(row: StreamEventRow) -> bytes:
            return events.sse("message", render(row), row.id)

        return StreamingResponse(events.event_stream(request.app.state.event_hub, cursor, filters, one),
                                 media_type="text/event-stream", headers=events.SSE_HEADERS)  # fmt: skip

    @r.get("/ui/stream/tasks")
    async def stream_tasks(request: Request, state: str = "", name: str = "", node: str = "") -> StreamingResponse:
        store: Store = request.app.state.store
        filters = await events.parse_filters(store, None, node or None, None, "task")
        cursor = _parse_from(request.query_params.get("from"))

        def render(e: StreamEventRow) -> str:
            if (state and e.state != state) or (name and e.task_name != name):
                return ""
            return fragment("_task_row_event.html", e=e, new=e.from_state is None)

        return await _stream(request, filters, cursor, render)

    @r.get("/ui/stream/task/{task_id}")
    async def stream_task(request: Request, task_id: str) -> StreamingResponse:
        tid = _uuid(task_id)
        filters = events.Filters(tid, None, None, {"task"})
        return await _stream(request, filters, _parse_from(request.query_params.get("from")),
                             lambda e: fragment("_task_event.html", e=e))  # fmt: skip

    @r.get("/ui/stream/nodes")
    async def stream_nodes(request: Request) -> StreamingResponse:
        filters = events.Filters(None, None, None, {"node"})
        return await _stream(request, filters, _parse_from(request.query_params.get("from")),
                             lambda e: fragment("_node_event.html", e=e))  # fmt: skip

    @r.get("/ui/stream/logs/{task_id}")
    async def stream_logs(request: Request, task_id: str) -> StreamingResponse:
        await _who(request)
        tid = _uuid(task_id)
        store: Store = request.app.state.store
        await store.get_task(tid)
        last = request.headers.get("last-event-id", "")
        after = int(last) if last.isdigit() else 0

        def chunk(row: LogChunkRow) -> bytes:
            text = bytes(row.data).decode("utf-8", errors="replace")
            return events.sse("chunk", fragment("_log_chunk.html", text=text, stream=row.stream), row.id)

        def end(t: TaskRow) -> bytes:
            return events.sse("end", fragment("_log_end.html", t=t))

        return StreamingResponse(events.log_stream(store, request.app.state.event_hub, tid, after, chunk, end),
                                 media_type="text/event-stream", headers=events.SSE_HEADERS)  # fmt: skip

    return r


def error_page(request: Request, exc: Exception) -> Response | None:
    """How the UI answers its own errors: sign-in for a missing session, a page with the sentence for
    the rest. None: not a UI request (the API's JSON handlers answer)."""
    path = request.url.path
    if path.startswith("/v1/") or path in ("/docs", "/openapi.json", "/healthz", "/metrics"):
        return None
    if isinstance(exc, SignedOut | Unauthorized):
        if path.startswith("/ui/stream/"):
            return Response("sign in first", status_code=401)
        return _back("/signin", "sign in first" if isinstance(exc, SignedOut) else str(exc))
    codes: dict[type[Exception], int] = {Forbidden: 403, NotFound: 404, InvalidRequest: 422, Conflict: 409, StoreUnavailable: 503}
    status = codes.get(type(exc), 500)
    return page(request, "error.html", status=status, who=None, message=str(exc), status_code=status)
