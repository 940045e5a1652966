"""A property-based fuzz run of the whole REST API from its own OpenAPI document (schemathesis).

The app is the real one (`create_app`) over a real Store on the system PostgreSQL 15, a real
Scheduler (its loops do not run) and a real Security with a random key, driven in-process over ASGI:
no sockets. Two passes over every operation:

- with an admin token: no 5xx, and every status code, content type and body is one the document
  declares for that operation;
- without a token: every /v1/ call is refused with 401 and an {"error": …} body.

Event loops: schemathesis's ASGI client runs every request, and the app's ASGI lifespan, on one
event-loop thread of its own. An asyncpg pool works only on the loop it was made on, so the Store is
connected in the lifespan startup (`_ServedApp`), never on the test's thread.

One database serves the whole module, so what one operation stores (tasks, specs, secrets, tokens)
is what the list operations after it return and have checked against the schema.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from podium.api.app import create_app
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.spec import TaskSpec
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node

# Examples per operation in the fuzzing phase. The authenticated pass also runs schemathesis's
# coverage phase (boundary and wrong-type values for every field, a fixed set per operation), which
# is what finds type confusions; the anonymous pass needs only a few calls per operation.
AUTHED_EXAMPLES = 15
ANONYMOUS_EXAMPLES = 5
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class _ServedApp:
    """`create_app(store, scheduler, security)`, built in the ASGI lifespan startup so the Store's
    pool lives on the loop that serves the requests, and closed in the lifespan shutdown."""

    def __init__(self, url: str, key: bytes) -> None:
        self.url = url
        self.key = key
        self.app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        assert self.app is not None, "the lifespan did not start"
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        store: Store | None = None
        scheduler: Scheduler | None = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    store = await Store.connect(self.url, min_size=1, max_size=5)
                    scheduler = Scheduler(store, DEFAULT_TIMING, server_id="fuzz")
                    self.app = create_app(store, scheduler, Security(store, SecretBox(self.key)))
                except Exception as e:  # the client raises it in the test
                    await send({"type": "lifespan.startup.failed", "message": repr(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if scheduler is not None:
                    await scheduler.close()
                if store is not None:
                    await store.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


@dataclass(frozen=True)
class Served:
    app: _ServedApp
    token_id: str  # the admin token's id and value
    token: str


async def _prepare(url: str, key: bytes) -> tuple[str, str]:
    """An admin token (through Security), a node and a task, on a short-lived pool of the test's
    own loop: list operations then return rows, not only []."""
    store = await Store.connect(url, min_size=1, max_size=1)
    try:
        row, token = await Security(store, SecretBox(key)).create_token("fuzzer", Role.ADMIN, by="test")
        await add_node(store, "fuzz-node", labels={"zone": "eu-1"})
        await store.submit(TaskSpec(command=["true"], name="seeded"))
        return row.id, token
    finally:
        await store.close()


@pytest.fixture(scope="module")
def served(pg15: Any) -> Iterator[Served]:
    """The app on a fresh migrated database of PostgreSQL 15 (what `e2e_db_url` gives, made here
    directly because that fixture is per test and this database is shared by every operation)."""
    url = pg15.new_database()
    try:
        key = os.urandom(32)
        token_id, token = asyncio.run(_prepare(url, key))
        yield Served(_ServedApp(url, key), token_id, token)
    finally:
        # The ASGI client keeps a started lifespan for the rest of the process; end it (which
        # closes the pool) before the database is dropped.
        asgi.shutdown_lifespans()
        pg15.drop_database(url)


# The API's own OpenAPI document. `create_app` only keeps its arguments for the handlers, so this is
# the document the app serves (test_served_document_is_the_fuzzed_one checks it). Loading it per
# test with `schemathesis.pytest.from_fixture` does not work with schemathesis 4.32.5 on pytest 9 (it
# sets `Function._nodeid`, which pytest 9 no longer has); built at import, it needs no database.
DOCUMENT = create_app(None, None, None).openapi()  # type: ignore[arg-type]


def _schema(examples: int, *, coverage: bool) -> Any:
    config = {"generation": {"max-examples": examples}, "phases": {"coverage": {"enabled": coverage}}}
    return schemathesis.openapi.from_dict(DOCUMENT, config=schemathesis.Config.from_dict(config))


# The event streams (server-sent events) never end by themselves; they are tested end to end in
# tests/acceptance/test_events.py. The anonymous pass still checks that they refuse without a token.
authed = _schema(AUTHED_EXAMPLES, coverage=True).exclude(path_regex=r"^/v1/events$|^/v1/tasks/\{task_id\}/logs/stream$")
anonymous = _schema(ANONYMOUS_EXAMPLES, coverage=False).include(path_regex=r"^/v1/")


def _settings(examples: int) -> Any:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def _no_follow(case: schemathesis.Case) -> None:
    # `GET /v1/tasks/{id}/logs?follow=true` streams NDJSON until the task ends. Nothing here runs
    # agents, so no task ever ends and the stream would never close: the request would hang the
    # suite. The streaming mode is covered end to end elsewhere; here it is always off.
    if case.operation.path == "/v1/tasks/{task_id}/logs" and case.query and "follow" in case.query:
        case.query["follow"] = "false"


def _plausible_spec(spec: dict[str, Any]) -> None:
    """Make a positive (schema-valid) spec one the server accepts, in place.

    The document declares the spec's types and bounds but not its finer rules (name patterns, env
    and label keys, a process task needs a command, …), so almost every spec the fuzzer makes from the
    document alone is refused with 422 and the accepting path would never be fuzzed. Fields the
    product's own validation refuses are dropped (secrets always: none exist), then the backend's
    needs are met."""
    for field in [f for f in spec if f not in ("backend", "command", "image", "idempotency_key")]:
        try:
            TaskSpec.model_validate({"command": ["true"], field: spec[field]})
        except Exception:
            del spec[field]
    spec.pop("secrets", None)
    if spec.get("backend", "process") == "process":
        spec.pop("image", None)
        command = spec.get("command")
        if not command or not isinstance(command, list) or any("\x00" in str(a) for a in command):
            spec["command"] = ["true"]
    elif not spec.get("image"):
        spec["image"] = "localhost/busybox:test"


def _plausible(case: schemathesis.Case) -> None:
    if case.meta is None or case.meta.generation.mode.is_negative or not isinstance(case.body, dict):
        return
    if (case.method.upper(), case.operation.path) in {("POST", "/v1/tasks"), ("PUT", "/v1/specs/{name}")}:
        _plausible_spec(case.body)
    elif (case.method.upper(), case.operation.path) == ("POST", "/v1/tasks/batch"):
        for spec in case.body.get("tasks") or []:
            if isinstance(spec, dict):
                _plausible_spec(spec)


def test_served_document_is_the_fuzzed_one(served: Served) -> None:
    with asgi.get_client(served.app) as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == DOCUMENT


# ---- the fuzz runs ------------------------------------------------------------------------------


@authed.parametrize()
@_settings(AUTHED_EXAMPLES)
def test_api_fuzz_authenticated(case: schemathesis.Case, served: Served) -> None:
    """With an admin token: no 5xx, every status, content type and body as the document says."""
    _no_follow(case)
    _plausible(case)
    if case.operation.path == "/v1/tokens/{token_id}" and case.path_parameters.get("token_id") == served.token_id:
        case.path_parameters["token_id"] = "not-the-fuzzers-own"  # revoking itself would end the run's auth
    headers = {"Authorization": f"Bearer {served.token}"}
    response = case.call(app=served.app, headers=headers)
    case.validate_response(
        response, checks=CHECKS, headers=headers, transport_kwargs={"app": served.app, "headers": headers}
    )


@anonymous.parametrize()
@_settings(ANONYMOUS_EXAMPLES)
def test_api_refuses_anonymous_calls(case: schemathesis.Case, served: Served) -> None:
    """Without a token every /v1/ call is refused with 401, whatever its parameters and body."""
    _no_follow(case)
    if case.headers:
        case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
    response = case.call(app=served.app)
    where = f"{case.method} {case.formatted_path} {response.request.body!r:.200}: {response.status_code} {response.text[:300]}"
    if case.method.upper() != case.operation.method.upper():
        # a coverage phase also tries methods the path does not have: refused either way, as
        # anonymous (401) or as no such method (405)
        assert response.status_code in (401, 405), where
        return
    assert response.status_code == 401, where
    assert response.headers.get("www-authenticate") == ["Bearer"], where
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], where
