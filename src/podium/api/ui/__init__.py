"""The web UI, the event stream and the offline API docs, installed on the API app by `install`.

The UI is server-rendered (Jinja2, autoescaped) with htmx and its SSE extension for live updates,
both vendored; every page carries a Content-Security-Policy that allows only this server's own
scripts and styles. The UI signs in with a token and keeps a session cookie; every state-changing
form carries the session's CSRF token. It changes tasks and nodes only through the same store and
scheduler calls as the REST API, and must never render a byte of task output or a name unescaped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from podium.api import events
from podium.api.session import Sessions, SignedOut
from podium.api.ui import docs, pages
from podium.errors import Conflict, Forbidden, InvalidRequest, NotFound, StoreUnavailable, Unauthorized
from podium.scheduler.service import Scheduler
from podium.security.service import Security
from podium.store import Store
from podium.store.ui import UiStore

STATIC = Path(__file__).parent / "static"


def install(app: FastAPI, store: Store, scheduler: Scheduler, security: Security, *, hub_store: Store | None = None) -> None:
    ui = UiStore(store)
    app.state.store = store
    app.state.scheduler = scheduler
    app.state.ui_store = ui
    app.state.sessions = Sessions(ui, security)
    app.state.event_hub = events.EventHub(store, ui, reads=None if hub_store is None else UiStore(hub_store))
    app.include_router(events.router())
    app.include_router(docs.router())
    app.include_router(pages.router())
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    # UI pages answer errors with a page (or a redirect to sign-in); the API keeps its JSON answers
    for exc_type in (SignedOut, Unauthorized, Forbidden, NotFound, InvalidRequest, Conflict, StoreUnavailable):
        app.add_exception_handler(exc_type, _ui_or_api(app.exception_handlers.get(exc_type)))


def _ui_or_api(api_handler: Any) -> Any:
    async def handle(request: Request, exc: Exception) -> Response:
        answer = pages.error_page(request, exc)
        if answer is not None:
            return answer
        if api_handler is None:
            return JSONResponse({"error": str(exc)}, status_code=401)
        return await api_handler(request, exc)

    return handle


def close(app: FastAPI) -> None:
    """End the event streams: the server is stopping."""
    hub = getattr(app.state, "event_hub", None)
    if hub is not None:
        hub.close()
