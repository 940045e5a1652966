"""Every API endpoint validates its input: bad input gets a 4xx whose `error` names the field and the
problem, and nothing stored changes.

The real app (`create_app`) over a real Store on the system PostgreSQL 15, a real Scheduler (its loops
do not run) and a real Security, driven in-process through httpx's ASGI transport. "Nothing changed"
is checked on the content of every table a request could write, not only on row counts.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from podium.api.app import create_app
from podium.api.guard import MAX_BODY
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.spec import TaskSpec
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import add_node

# Every table an API call can write. A digest of each table's rows, so a changed row counts too.
TABLES = ("tasks", "task_events", "attempts", "named_specs", "api_tokens", "secrets", "audit_log", "nodes")
UNKNOWN_TASK = "3f2a9c1e-0000-4000-8000-000000000000"
# `authorization` values standing for a header made from the fixture's tokens
REAL_ID_WRONG_SECRET = "<the operator token's id with another secret>"
REVOKED = "<a revoked operator token>"


@dataclass
class Api:
    client: httpx.AsyncClient
    store: Store
    tokens: dict[str, str]  # role (and "revoked") -> "Bearer …" header value
    task_id: uuid.UUID

    async def snapshot(self) -> dict[str, tuple[int, str | None]]:
        out = {}
        async with self.store.pool.acquire() as c:
            for t in TABLES:
                out[t] = tuple(await c.fetchrow(f"SELECT count(*), md5(string_agg(r::text, '|' ORDER BY r::text)) FROM {t} r"))
        return out


@pytest.fixture
async def api(e2e_db_url: str) -> AsyncIterator[Api]:
    store = await Store.connect(e2e_db_url, min_size=1, max_size=5)
    scheduler = Scheduler(store, DEFAULT_TIMING, server_id="validation")
    security = Security(store, SecretBox(os.urandom(32)))
    tokens = {}
    for role in (Role.VIEWER, Role.OPERATOR, Role.ADMIN):
        _row, token = await security.create_token(f"test-{role}", role, by="test")
        tokens[str(role)] = f"Bearer {token}"
    revoked, token = await security.create_token("test-revoked", Role.OPERATOR, by="test")
    await store.revoke_token(revoked.id)
    tokens["revoked"] = f"Bearer {token}"
    await add_node(store, "n1", labels={"zone": "eu-1"})
    row, _ = await store.submit(TaskSpec(command=["true"], name="seeded"))
    app = create_app(store, scheduler, security)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://podium") as client:
        yield Api(client, store, tokens, row.id)
    await scheduler.close()
    await store.close()


@dataclass(frozen=True)
class Bad:
    """One bad request, what it must get, and the words its `error` must contain (the field and
    the problem)."""

    id: str
    method: str
    path: str
    status: int
    says: tuple[str, ...]
    json: Any = None
    content: bytes | None = None
    role: str | None = "admin"  # None: no Authorization header
    authorization: str | None = None  # overrides role
    headers: dict[str, str] = field(default_factory=dict)


SPEC = {"command": ["true"]}

CASES = [
    # ---- a bad spec --------------------------------------------------------------------------
    Bad("unknown-field", "POST", "/v1/tasks", 422, ("bogus", "not permitted"), json={**SPEC, "bogus": 1}),
    Bad("unknown-resource-field", "POST", "/v1/tasks", 422, ("resources.cpus", "not permitted"),
        json={**SPEC, "resources": {"cpus": 2}}),
    Bad("empty-command", "POST", "/v1/tasks", 422, ("command", "non-empty"), json={"command": []}),
    Bad("no-command", "POST", "/v1/tasks", 422, ("command", "process task"), json={}),
    Bad("container-without-image", "POST", "/v1/tasks", 422, ("image", "container"), json={"backend": "container"}),
    Bad("process-with-image", "POST", "/v1/tasks", 422, ("image", "container"), json={**SPEC, "image": "busybox"}),
    Bad("unknown-backend", "POST", "/v1/tasks", 422, ("backend", "process", "container"), json={**SPEC, "backend": "vm"}),
    Bad("malformed-image", "POST", "/v1/tasks", 422, ("image", "'Team/App:1.4'", "not an image reference"),
        json={"backend": "container", "image": "Team/App:1.4"}),
    Bad("image-with-a-space", "POST", "/v1/tasks", 422, ("image", "not an image reference"),
        json={"backend": "container", "image": "busy box"}),
    Bad("image-empty-tag", "POST", "/v1/tasks", 422, ("image", "not an image reference"),
        json={"backend": "container", "image": "busybox:"}),
    Bad("image-short-digest", "POST", "/v1/tasks", 422, ("image", "not an image reference"),
        json={"backend": "container", "image": "busybox@sha256:abc"}),
    Bad("unknown-egress", "POST", "/v1/tasks", 422, ("egress", "'none'", "'open'"),
        json={"backend": "container", "image": "busybox", "egress": "closed"}),
    Bad("process-without-network", "POST", "/v1/tasks", 422, ("egress none", "container"), json={**SPEC, "egress": "none"}),
    Bad("batch-one-bad-image", "POST", "/v1/tasks/batch", 422, ("tasks.1", "image", "not an image reference"),
        json={"tasks": [SPEC, {"backend": "container", "image": "UPPER"}]}),
    Bad("named-spec-bad-egress", "PUT", "/v1/specs/nightly", 422, ("egress", "'none'", "'open'"),
        json={**SPEC, "egress": "maybe"}),
    Bad("command-not-a-list", "POST", "/v1/tasks", 422, ("command", "list"), json={"command": "true"}),
    Bad("nul-in-command", "POST", "/v1/tasks", 422, ("command", "NUL"), json={"command": ["a\x00b"]}),
    Bad("bad-env-name", "POST", "/v1/tasks", 422, ("env", "1X", "not a valid environment variable"),
        json={**SPEC, "env": {"1X": "v"}}),
    Bad("bad-task-name", "POST", "/v1/tasks", 422, ("name", "-x", "not valid"), json={**SPEC, "name": "-x"}),
    Bad("priority-too-high", "POST", "/v1/tasks", 422, ("priority", "1000"), json={**SPEC, "priority": 1001}),
    Bad("max-attempts-zero", "POST", "/v1/tasks", 422, ("max_attempts", "greater than or equal to 1"),
        json={**SPEC, "max_attempts": 0}),
    Bad("missing-secret", "POST", "/v1/tasks", 422, ("secrets", "'nope'", "not exist"),
        json={**SPEC, "secrets": [{"name": "nope", "env": "TOKEN"}]}),
    Bad("spec-not-an-object", "POST", "/v1/tasks", 422, ("body", "object"), json=["true"]),
    Bad("body-not-json", "POST", "/v1/tasks", 422, ("JSON",), content=b"{command: true",
        headers={"content-type": "application/json"}),
    Bad("named-spec-unknown-field", "PUT", "/v1/specs/nightly", 422, ("bogus", "not permitted"), json={**SPEC, "bogus": 1}),
    Bad("named-spec-bad-name", "PUT", "/v1/specs/-nightly", 422, ("name", "-nightly", "not valid"), json=SPEC),
    Bad("batch-one-bad-task", "POST", "/v1/tasks/batch", 422, ("tasks.1", "command", "non-empty"),
        json={"tasks": [SPEC, {"command": []}]}),
    # ---- a bad size --------------------------------------------------------------------------
    Bad("size-unknown-unit", "POST", "/v1/tasks", 422, ("resources.memory", "12XB", "unknown unit"),
        json={**SPEC, "resources": {"memory": "12XB"}}),
    Bad("size-not-a-size", "POST", "/v1/tasks", 422, ("resources.disk", "lots", "not a size"),
        json={**SPEC, "resources": {"disk": "lots"}}),
    Bad("size-negative", "POST", "/v1/tasks", 422, ("resources.memory", "non-negative"),
        json={**SPEC, "resources": {"memory": -1}}),
    Bad("size-too-large", "POST", "/v1/tasks", 422, ("resources.memory", "too large"),
        json={**SPEC, "resources": {"memory": "9999999Ti"}}),
    Bad("cpu-not-an-amount", "POST", "/v1/tasks", 422, ("resources.cpu", "many", "not a CPU amount"),
        json={**SPEC, "resources": {"cpu": "many"}}),
    # ---- a bad duration ----------------------------------------------------------------------
    Bad("duration-word", "POST", "/v1/tasks", 422, ("timeout", "soon", "not a duration"), json={**SPEC, "timeout": "soon"}),
    Bad("duration-zero", "POST", "/v1/tasks", 422, ("timeout", "positive"), json={**SPEC, "timeout": 0}),
    # ---- a bad label -------------------------------------------------------------------------
    Bad("label-key-in-spec", "POST", "/v1/tasks", 422, ("labels", "-bad", "not valid"),
        json={**SPEC, "labels": {"-bad": "x"}}),
    Bad("label-value-in-spec", "POST", "/v1/tasks", 422, ("labels", "zone", "invalid value"),
        json={**SPEC, "labels": {"zone": "eu 1"}}),
    Bad("label-key-on-node", "PUT", "/v1/nodes/n1/labels", 422, ("labels", "a b", "not valid"),
        json={"labels": {"a b": "x"}}),
    Bad("labels-not-an-object", "PUT", "/v1/nodes/n1/labels", 422, ("labels", "dictionary"), json={"labels": ["zone=eu-1"]}),
    # ---- a bad id ----------------------------------------------------------------------------
    Bad("task-id-not-a-uuid", "GET", "/v1/tasks/not-a-uuid", 422, ("not-a-uuid", "not a task id")),
    Bad("cancel-id-not-a-uuid", "POST", "/v1/tasks/not-a-uuid/cancel", 422, ("not-a-uuid", "not a task id"), role="operator"),
    Bad("logs-id-not-a-uuid", "GET", "/v1/tasks/not-a-uuid/logs", 422, ("not-a-uuid", "not a task id")),
    Bad("explain-id-not-a-uuid", "GET", "/v1/tasks/not-a-uuid/explain", 422, ("not-a-uuid", "not a task id")),
    Bad("unknown-task", "GET", f"/v1/tasks/{UNKNOWN_TASK}", 404, (UNKNOWN_TASK, "no task")),
    Bad("cancel-unknown-task", "POST", f"/v1/tasks/{UNKNOWN_TASK}/cancel", 404, (UNKNOWN_TASK, "no task"), role="operator"),
    Bad("logs-unknown-task", "GET", f"/v1/tasks/{UNKNOWN_TASK}/logs", 404, (UNKNOWN_TASK, "no task")),
    Bad("unknown-node", "POST", "/v1/nodes/n9/drain", 404, ("n9", "no node"), role="operator"),
    Bad("unknown-spec", "GET", "/v1/specs/nightly", 404, ("nightly", "no spec")),
    Bad("unknown-token", "DELETE", "/v1/tokens/abc123", 404, ("abc123", "no active token")),
    Bad("logs-negative-after", "GET", f"/v1/tasks/{UNKNOWN_TASK}/logs?after=-1", 422, ("after", "greater than or equal to 0")),
    Bad("list-limit-zero", "GET", "/v1/tasks?limit=0", 422, ("limit", "greater than or equal to 1")),
    Bad("list-unknown-state", "GET", "/v1/tasks?state=sleeping", 422, ("state", "queued")),
    # ---- an oversized body -------------------------------------------------------------------
    Bad("body-over-1MiB", "POST", "/v1/tasks", 413, ("body", "larger than 1048576 bytes"),
        content=b'{"command": ["true"], "env": {"A": "' + b"x" * MAX_BODY + b'"}}', headers={"content-type": "application/json"}),
    Bad("secret-over-1MiB", "PUT", "/v1/secrets/big", 413, ("body", "larger than 1048576 bytes"),
        content=b'{"value": "' + b"x" * MAX_BODY + b'"}', headers={"content-type": "application/json"}),
    # ---- the wrong role ----------------------------------------------------------------------
    Bad("viewer-submits", "POST", "/v1/tasks", 403, ("viewer", "operator"), json=SPEC, role="viewer"),
    Bad("viewer-cancels", "POST", f"/v1/tasks/{UNKNOWN_TASK}/cancel", 403, ("viewer", "operator"), role="viewer"),
    Bad("operator-creates-token", "POST", "/v1/tokens", 403, ("operator", "admin"),
        json={"name": "x", "role": "admin"}, role="operator"),
    Bad("operator-reads-audit", "GET", "/v1/audit", 403, ("operator", "admin"), role="operator"),
    # ---- a bad token -------------------------------------------------------------------------
    Bad("no-token", "POST", "/v1/tasks", 401, ("bearer token",), json=SPEC, role=None),
    Bad("unknown-token-value", "POST", "/v1/tasks", 401, ("token", "not valid"), json=SPEC,
        authorization="Bearer pdm_000000000000.c2VjcmV0"),
    Bad("wrong-secret", "POST", "/v1/tasks", 401, ("token", "not valid"), json=SPEC,
        authorization=REAL_ID_WRONG_SECRET),
    Bad("revoked-token", "POST", "/v1/tasks", 401, ("token", "revoked"), json=SPEC, authorization=REVOKED),
    Bad("not-a-bearer", "POST", "/v1/tasks", 401, ("Bearer",), json=SPEC, authorization="Basic dXNlcjpwYXNz"),
    Bad("garbage-token", "GET", "/v1/tasks", 401, ("Bearer",), authorization="Bearer nonsense"),
]


def _auth(api: Api, case: Bad) -> dict[str, str]:
    if case.authorization == REVOKED:
        return {"Authorization": api.tokens["revoked"]}
    if case.authorization == REAL_ID_WRONG_SECRET:
        token_id = api.tokens["operator"].removeprefix("Bearer pdm_").split(".", 1)[0]
        return {"Authorization": f"Bearer pdm_{token_id}.c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"}
    if case.authorization is not None:
        return {"Authorization": case.authorization}
    if case.role is None:
        return {}
    return {"Authorization": api.tokens[case.role]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_request_is_refused_and_changes_nothing(api: Api, case: Bad) -> None:
    before = await api.snapshot()
    kwargs: dict[str, Any] = {"headers": {**_auth(api, case), **case.headers}}
    if case.json is not None:
        kwargs["json"] = case.json
    if case.content is not None:
        kwargs["content"] = case.content
    response = await api.client.request(case.method, case.path, **kwargs)

    assert response.status_code == case.status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, str) and error
    for word in case.says:
        assert word in error, f"{word!r} is not in the error {error!r}"
    if case.status == 401:
        assert response.headers.get("www-authenticate") == "Bearer"
    assert await api.snapshot() == before, "a refused request changed what is stored"


async def test_chunked_body_over_the_limit_is_refused(api: Api) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"command": ["true"], "env": {"A": "'
        for _ in range(2 * MAX_BODY // 65536):
            yield b"x" * 65536
        yield b'"}}'

    before = await api.snapshot()
    response = await api.client.post(
        "/v1/tasks", content=chunks(), headers={"Authorization": api.tokens["operator"], "content-type": "application/json"}
    )
    assert response.status_code == 413, response.text[:300]
    assert "larger than" in response.json()["error"]
    assert await api.snapshot() == before


async def test_a_good_request_does_change_things(api: Api) -> None:
    """The snapshot sees a change when there is one (so the refusals above are not vacuous)."""
    before = await api.snapshot()
    response = await api.client.post("/v1/tasks", json=SPEC, headers={"Authorization": api.tokens["operator"]})
    assert response.status_code == 201, response.text
    after = await api.snapshot()
    assert after["tasks"][0] == before["tasks"][0] + 1
    assert after["tasks"] != before["tasks"]

    before = after
    response = await api.client.put("/v1/nodes/n1/labels", json={"labels": {"zone": "eu-2"}},
                                    headers={"Authorization": api.tokens["operator"]})
    assert response.status_code == 200, response.text
    assert (await api.snapshot())["nodes"] != before["nodes"]


async def test_the_seeded_task_is_found(api: Api) -> None:
    """The ids the cases use as unknown are unknown only because they are: a real id is found."""
    response = await api.client.get(f"/v1/tasks/{api.task_id}", headers={"Authorization": api.tokens["viewer"]})
    assert response.status_code == 200, response.text
    assert response.json()["name"] == "seeded"
