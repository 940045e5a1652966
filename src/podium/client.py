"""A Python client of the Podium API: `Client` (sync) and `AsyncClient` (async), typed results.

It finds the server and the token (PODIUM_ADDR, PODIUM_TOKEN, then the token `podium dev` left in
the user's config dir; PODIUM_CA_FILE for TLS) with the functions below, which the CLI uses too: the
CLI is a client of this module, never the other way round. Streams (`events`, `logs(follow=True)`, `run`) are server-sent events and resume after the
last id they delivered when a connection drops, so a server restart loses nothing and repeats nothing.
It never retries a submission without the caller's idempotency key.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import platformdirs

__all__ = ["AsyncClient", "Client", "Event", "LogChunk", "Node", "PodiumError", "RunResult", "Task"]

RECONNECT_SECONDS = 120.0  # how long a stream keeps trying to get back to a server that went away
DEFAULT_ADDR = "http://127.0.0.1:8642"


def normalise_addr(addr: str | None) -> str:
    """The server's base URL: `addr`, else PODIUM_ADDR, else the local default; http:// if no scheme."""
    addr = (addr or os.environ.get("PODIUM_ADDR") or DEFAULT_ADDR).strip().rstrip("/")
    if "://" not in addr:
        addr = "http://" + addr
    return addr


def token_file() -> Path:
    """Where `podium dev` leaves an admin token for this user (owner-only)."""
    return Path(platformdirs.user_config_dir("podium")) / "token"


def find_token() -> str | None:
    """PODIUM_TOKEN, else the token `podium dev` left in the user's config dir."""
    if os.environ.get("PODIUM_TOKEN"):
        return os.environ["PODIUM_TOKEN"].strip()
    path = token_file()
    if path.exists():
        return path.read_text().strip() or None
    return None


def tls_verify() -> ssl.SSLContext | bool:
    """The CA to trust: PODIUM_CA_FILE, else the system's."""
    ca_file = os.environ.get("PODIUM_CA_FILE")
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def connection(addr: str | None = None, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
    """An HTTP connection to the server, found and authenticated as every Podium client does."""
    base = normalise_addr(addr)
    tok = token or find_token()
    headers = {"Authorization": f"Bearer {tok}"} if tok else {}
    return httpx.Client(base_url=base, timeout=timeout, headers=headers, verify=tls_verify())


class PodiumError(Exception):
    """The server refused a call (`status` is the HTTP status) or could not be reached (status 0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Task:
    id: str
    name: str | None
    state: str
    reason: str | None
    terminal: bool
    exit_code: int | None
    node_id: str | None
    attempts: int
    created_at: str
    spec: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, d: dict[str, Any]) -> Task:
        return cls(d["id"], d.get("name"), d["state"], d.get("reason"), bool(d.get("terminal")), d.get("exit_code"),
                   d.get("node_id"), int(d.get("attempts") or 0), d.get("created_at", ""), d.get("spec") or {})  # fmt: skip


@dataclass(frozen=True)
class Node:
    id: str
    name: str
    health: str
    connected: bool
    draining: bool
    labels: dict[str, str]
    allocatable: dict[str, int]
    reserved: dict[str, int]

    @classmethod
    def of(cls, d: dict[str, Any]) -> Node:
        return cls(d["id"], d["name"], d["health"], d["connected"], d["draining"], d.get("labels") or {},
                   d.get("allocatable") or {}, d.get("reserved") or {})  # fmt: skip


@dataclass(frozen=True)
class Event:
    """One event of the stream: `kind` "task" (state, reason, attempt, node_id) or "node" (health,
    connected, draining)."""

    id: int
    kind: str
    at: str
    task_id: str | None = None
    from_state: str | None = None
    state: str | None = None
    reason: str | None = None
    attempt: int | None = None
    node_id: str | None = None
    health: str | None = None
    connected: bool | None = None
    draining: bool | None = None

    @classmethod
    def of(cls, d: dict[str, Any]) -> Event:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class LogChunk:
    id: int
    attempt: int
    stream: str
    data: str


@dataclass(frozen=True)
class RunResult:
    task: Task
    exit_code: int | None
    output: str

    @property
    def ok(self) -> bool:
        return self.task.state == "succeeded"


class _Sse:
    """Parses server-sent events line by line."""

    def __init__(self) -> None:
        self.cur: dict[str, str] = {}

    def feed(self, line: str) -> tuple[str, str, str | None] | None:
        if line == "":
            cur, self.cur = self.cur, {}
            if "data" in cur:
                return cur.get("event", "message"), cur["data"], cur.get("id")
            return None
        if line.startswith(":"):
            return None
        k, _, v = line.partition(":")
        v = v[1:] if v.startswith(" ") else v
        self.cur[k] = self.cur[k] + "\n" + v if k == "data" and k in self.cur else v
        return None


def _settings(addr: str | None, token: str | None) -> tuple[str, dict[str, str], ssl.SSLContext | bool]:
    base = normalise_addr(addr)
    tok = token or find_token()
    headers = {"Authorization": f"Bearer {tok}"} if tok else {}
    return base, headers, tls_verify()


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            msg = r.json().get("error") or r.text
        except (json.JSONDecodeError, AttributeError):
            msg = r.text or r.reason_phrase
        raise PodiumError(str(msg), r.status_code)
    return None if r.status_code == 204 else r.json()


def _spec(command: list[str] | None, spec: dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    body = dict(spec or {})
    if command is not None:
        body["command"] = list(command)
    body.update(fields)
    return body


def _events_params(task: str | None, node: str | None, state: str | None, kind: str | None) -> dict[str, str]:
    return {k: v for k, v in (("task", task), ("node", node), ("state", state), ("kind", kind)) if v}


class Client:
    """The synchronous client. `Client()` finds the server and token as the CLI does."""

    def __init__(self, addr: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.http = connection(addr, token, timeout)
        self.addr = str(self.http.base_url).rstrip("/")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _check(self.http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise PodiumError(f"cannot reach the Podium server at {self.addr}: {e}") from None

    def submit(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None,
               idempotency_key: str | None = None, **fields: Any) -> Task:  # fmt: skip
        """Submit a task: a command and any spec fields (name, resources, labels, …)."""
        body = _spec(command, spec, fields)
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        return Task.of(self._call("POST", "/v1/tasks", json=body)["task"])

    def submit_many(self, specs: list[dict[str, Any]]) -> list[Task]:
        """Submit up to 1,000 task specs in one transaction: all are stored, or none. In their order."""
        return [Task.of(r["task"]) for r in self._call("POST", "/v1/tasks/batch", json={"tasks": specs})]

    def task(self, task_id: str) -> Task:
        return Task.of(self._call("GET", f"/v1/tasks/{task_id}"))

    def cancel(self, task_id: str) -> Task:
        return Task.of(self._call("POST", f"/v1/tasks/{task_id}/cancel"))

    def nodes(self) -> list[Node]:
        return [Node.of(n) for n in self._call("GET", "/v1/nodes")]

    def _stream(self, path: str, params: dict[str, str], last_id: str | None) -> Iterator[tuple[str, str, str | None]]:
        """Server-sent events, reconnecting after the last id seen if the connection drops."""
        give_up: float | None = None
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with self.http.stream("GET", path, params=params, headers=headers, timeout=httpx.Timeout(30, read=None)) as r:
                    if r.status_code >= 400:
                        r.read()
                        _check(r)
                    give_up = None
                    sse = _Sse()
                    for line in r.iter_lines():
                        ev = sse.feed(line)
                        if ev is None:
                            continue
                        if ev[2]:
                            last_id = ev[2]
                        yield ev
                        if ev[0] == "end":
                            return
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                now = time.monotonic()
                give_up = give_up or now + RECONNECT_SECONDS
                if now > give_up:
                    raise PodiumError(f"lost the Podium server at {self.addr} and it did not come back") from None
                time.sleep(0.5)

    def events(self, *, task: str | None = None, node: str | None = None, state: str | None = None,
               kind: str | None = None, after: int | None = None) -> Iterator[Event]:  # fmt: skip
        """Task and node events from now on (or after event id `after`), forever."""
        for _name, data, _id in self._stream("/v1/events", _events_params(task, node, state, kind),
                                             None if after is None else str(after)):  # fmt: skip
            yield Event.of(json.loads(data))

    def logs(self, task_id: str, *, follow: bool = False) -> Iterator[LogChunk]:
        """A task's output; with follow=True, as it is written, until the task ends."""
        if not follow:
            after = 0
            while True:
                page = self._call("GET", f"/v1/tasks/{task_id}/logs", params={"after": after})
                for c in page["chunks"]:
                    yield LogChunk(c["id"], c["attempt"], c["stream"], c["data"])
                if not page["chunks"]:
                    return
                after = page["next_after"]
        for name, data, _id in self._stream(f"/v1/tasks/{task_id}/logs/stream", {}, None):
            if name == "chunk":
                c = json.loads(data)
                yield LogChunk(c["id"], c["attempt"], c["stream"], c["data"])

    def run(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None, **fields: Any) -> RunResult:
        """Submit a task, wait for it to end, and return its exit code and output."""
        task = self.submit(command, spec=spec, **fields)
        output = "".join(c.data for c in self.logs(task.id, follow=True))
        final = self.task(task.id)
        return RunResult(final, final.exit_code, output)


class AsyncClient:
    """The asynchronous client; the same calls as `Client`, awaited (streams are async iterators)."""

    def __init__(self, addr: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.addr, headers, verify = _settings(addr, token)
        self.http = httpx.AsyncClient(base_url=self.addr, timeout=timeout, headers=headers, verify=verify)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _check(await self.http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise PodiumError(f"cannot reach the Podium server at {self.addr}: {e}") from None

    async def submit(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None,
                     idempotency_key: str | None = None, **fields: Any) -> Task:  # fmt: skip
        body = _spec(command, spec, fields)
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        return Task.of((await self._call("POST", "/v1/tasks", json=body))["task"])

    async def task(self, task_id: str) -> Task:
        return Task.of(await self._call("GET", f"/v1/tasks/{task_id}"))

    async def cancel(self, task_id: str) -> Task:
        return Task.of(await self._call("POST", f"/v1/tasks/{task_id}/cancel"))

    async def nodes(self) -> list[Node]:
        return [Node.of(n) for n in await self._call("GET", "/v1/nodes")]

    async def _stream(self, path: str, params: dict[str, str], last_id: str | None) -> AsyncIterator[tuple[str, str, str | None]]:
        give_up: float | None = None
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with self.http.stream("GET", path, params=params, headers=headers,
                                            timeout=httpx.Timeout(30, read=None)) as r:  # fmt: skip
                    if r.status_code >= 400:
                        await r.aread()
                        _check(r)
                    give_up = None
                    sse = _Sse()
                    async for line in r.aiter_lines():
                        ev = sse.feed(line)
                        if ev is None:
                            continue
                        if ev[2]:
                            last_id = ev[2]
                        yield ev
                        if ev[0] == "end":
                            return
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                now = time.monotonic()
                give_up = give_up or now + RECONNECT_SECONDS
                if now > give_up:
                    raise PodiumError(f"lost the Podium server at {self.addr} and it did not come back") from None
                await asyncio.sleep(0.5)

    async def events(self, *, task: str | None = None, node: str | None = None, state: str | None = None,
                     kind: str | None = None, after: int | None = None) -> AsyncIterator[Event]:  # fmt: skip
        async for _name, data, _id in self._stream("/v1/events", _events_params(task, node, state, kind),
                                                   None if after is None else str(after)):  # fmt: skip
            yield Event.of(json.loads(data))

    async def logs(self, task_id: str, *, follow: bool = False) -> AsyncIterator[LogChunk]:
        if not follow:
            after = 0
            while True:
                page = await self._call("GET", f"/v1/tasks/{task_id}/logs", params={"after": after})
                for c in page["chunks"]:
                    yield LogChunk(c["id"], c["attempt"], c["stream"], c["data"])
                if not page["chunks"]:
                    return
                after = page["next_after"]
        async for name, data, _id in self._stream(f"/v1/tasks/{task_id}/logs/stream", {}, None):
            if name == "chunk":
                c = json.loads(data)
                yield LogChunk(c["id"], c["attempt"], c["stream"], c["data"])

    async def run(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None, **fields: Any) -> RunResult:
        task = await self.submit(command, spec=spec, **fields)
        output = "".join([c.data async for c in self.logs(task.id, follow=True)])
        final = await self.task(task.id)
        return RunResult(final, final.exit_code, output)
