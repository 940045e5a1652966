"""Every route of the API runs on the server's event loop: FastAPI runs a plain-function endpoint or
dependency in its thread pool, a hop to a worker thread and back (two thread wake-ups, and the GIL
passed twice) on every request that uses it. The app's dependencies only read `app.state`: the hop
cost a submission three such trips."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from podium.api.app import create_app


def _routes(routes: list[Any]) -> Iterator[APIRoute]:
    for r in routes:
        if isinstance(r, APIRoute):
            yield r
        elif hasattr(r, "original_router"):  # an included router (FastAPI keeps it whole)
            yield from _routes(r.original_router.routes)
        elif hasattr(r, "routes"):
            yield from _routes(r.routes)


def _calls(d: Dependant) -> Iterator[Any]:
    for sub in d.dependencies:
        yield sub.call
        yield from _calls(sub)


def _in_thread_pool(call: Any) -> bool:
    f = call if inspect.isfunction(call) or inspect.ismethod(call) else type(call).__call__
    return not inspect.iscoroutinefunction(f)


def test_no_endpoint_or_dependency_of_the_api_runs_in_the_thread_pool() -> None:
    app = create_app(None, None, None)  # type: ignore[arg-type]  # the routes only: nothing is served
    routes = list(_routes(app.routes))
    assert len(routes) > 40, "every router's routes were found"
    pooled = sorted({f"{r.path}: {getattr(c, '__qualname__', type(c).__name__)}"
                     for r in routes for c in (r.dependant.call, *_calls(r.dependant)) if _in_thread_pool(c)})  # fmt: skip
    assert pooled == []
