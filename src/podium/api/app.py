"""The REST API's app factory: the state the routers' dependencies read (podium.api.deps), the error
handlers that turn Podium's errors into statuses with one sentence, and the request guard. The
handlers themselves are in podium.api.routes, one router per noun; a database that is away is a
503, never a 500."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from podium import __version__
from podium.api.guard import RequestGuard
from podium.api.routes import ROUTERS
from podium.api.ui import install as install_ui
from podium.errors import (
    Ambiguous,
    Conflict,
    Contention,
    Forbidden,
    InvalidRequest,
    NotFound,
    Overloaded,
    PreconditionFailed,
    ProfileRevisionMismatch,
    StoreUnavailable,
    Unauthorized,
)
from podium.pressure import Pressure
from podium.scheduler.service import Scheduler
from podium.security.service import Security
from podium.store import Store

# Podium's errors and the HTTP status each one is; the message is the exception's own sentence.
_STATUS: dict[type[Exception], int] = {
    InvalidRequest: 422, NotFound: 404, Conflict: 409, Unauthorized: 401, Forbidden: 403, PreconditionFailed: 412,
    ProfileRevisionMismatch: 409,
}


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


async def _invalid(_r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"error": _validation_message(exc)}, status_code=422)


async def _podium_error(_r: Request, exc: Exception) -> JSONResponse:
    status = _STATUS[type(exc)]
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": str(exc)}, status_code=status, headers=headers)


async def _ambiguous(_r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Ambiguous)
    return JSONResponse({"error": str(exc), "candidates": exc.candidates}, status_code=409)


async def _unavailable(_r: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": f"{exc}; retry (with the same idempotency key for a submit)"}, status_code=503)


async def _contention(_r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Contention)
    # Contention passes: a 503 with Retry-After, never a 404 or a 500.
    return JSONResponse(
        {"error": f"{exc}; retry (with the same idempotency key for a submit)"},
        status_code=503,
        headers={"Retry-After": str(exc.retry_after)},
    )


async def _overloaded(_r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Overloaded)
    return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})


async def _http(_r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)


def create_app(
    store: Store, scheduler: Scheduler, security: Security, pressure: Pressure | None = None, *, hub_store: Store | None = None
) -> FastAPI:
    """The API over `store`; the event hub's own reads go to `hub_store` when given (`podium.server`
    gives it a session that plans them once)."""
    app = FastAPI(
        title="Podium",
        version=__version__,
        description="A control plane that runs work on a fleet of machines and tells the truth about it.",
        docs_url=None,  # served from vendored assets by podium.api.ui (works without the internet)
        redoc_url=None,
    )
    # What the routers' dependencies hand to their handlers (podium.api.deps).
    app.state.store = store
    app.state.scheduler = scheduler
    app.state.security = security
    app.state.admission = pressure or Pressure()

    app.add_exception_handler(RequestValidationError, _invalid)
    for exc_type in _STATUS:
        app.add_exception_handler(exc_type, _podium_error)
    app.add_exception_handler(Ambiguous, _ambiguous)
    app.add_exception_handler(StoreUnavailable, _unavailable)
    app.add_exception_handler(Contention, _contention)
    app.add_exception_handler(Overloaded, _overloaded)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_middleware(RequestGuard)

    for router in ROUTERS:
        app.include_router(router)
    install_ui(app, store, scheduler, security, hub_store=hub_store)  # the event stream, the web UI, /docs
    return app
