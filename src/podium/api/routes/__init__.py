"""The REST API's routers, one per noun. Each validates its input before touching the store, so bad
input gets a 4xx that names the field and the problem and changes nothing. A router only calls the
store, the scheduler and the security service it is given (podium.api.deps); it must never run SQL
or build a response for an error (the app's handlers do)."""

from __future__ import annotations

from fastapi import APIRouter

from podium.api.routes import audit, logs, nodes, registries, secrets, specs, system, tasks, tokens

# In the order the OpenAPI document lists them.
ROUTERS: tuple[APIRouter, ...] = (
    system.router, tasks.router, logs.router, specs.router, nodes.router, tokens.router, secrets.router,
    registries.router, audit.router,
)  # fmt: skip
