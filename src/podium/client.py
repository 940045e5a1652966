"""A Python client of the Podium API: `Client` (sync) and `AsyncClient` (async), typed results.

It finds the server and the token (PODIUM_ADDR, PODIUM_TOKEN, then the token `podium dev` left in
the user's config dir; PODIUM_CA_FILE for TLS) with the functions below. The CLI's operator commands
are clients of this module, never the other way round.

Each endpoint is written once, as a request spec (`Call`: method, path, query, body, and how to read
the answer) built by the `_api` functions; `Client` and `AsyncClient` only send them, over httpx's
sync and async transports. Paged listings (`_Pager`), log pages (`_LogPages`) and streams (`_Stream`)
keep their state in objects both transports drive, so the two never differ in what they ask.

Streams (`events`, `logs(follow=True)`, `run`) are server-sent events and resume after the last id
they delivered when a connection drops, so a server restart loses nothing and repeats nothing.
It never retries a submission without the caller's idempotency key; a 429 (overloaded: nothing was
stored) is retried only when the caller gives `overload_patience`.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import platformdirs

__all__ = ["AsyncClient", "Client", "Event", "LogChunk", "Node", "Page", "PodiumError", "RunResult", "Task", "TaskEnd"]

RECONNECT_SECONDS = 120.0  # how long a stream keeps trying to get back to a server that went away
DEFAULT_ADDR = "http://127.0.0.1:8642"
PAGE = 1000  # rows per request when a listing is read page by page (the API's largest page)
_STREAM_TIMEOUT = httpx.Timeout(30, read=None)  # a stream may be quiet for long; connecting may not

T = TypeVar("T")


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


def _settings(addr: str | None, token: str | None) -> tuple[str, dict[str, str], ssl.SSLContext | bool]:
    base = normalise_addr(addr)
    tok = token or find_token()
    headers = {"Authorization": f"Bearer {tok}"} if tok else {}
    return base, headers, tls_verify()


class PodiumError(Exception):
    """The server refused a call (`status` is the HTTP status) or could not be reached (status 0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


# ---- typed results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A task as the API shows it; `raw` is the whole answer (attempts and events for `task()`)."""

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
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # for a submission: False when its idempotency key had made this task before
    created: bool | None = field(default=None, compare=False)

    @classmethod
    def of(cls, d: dict[str, Any], created: bool | None = None) -> Task:
        return cls(d["id"], d.get("name"), d["state"], d.get("reason"), bool(d.get("terminal")), d.get("exit_code"),
                   d.get("node_id"), int(d.get("attempts") or 0), d.get("created_at", ""), d.get("spec") or {}, d,
                   created)  # fmt: skip


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
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, d: dict[str, Any]) -> Node:
        return cls(d["id"], d["name"], d["health"], d["connected"], d["draining"], d.get("labels") or {},
                   d.get("allocatable") or {}, d.get("reserved") or {}, d)  # fmt: skip


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
        values: dict[str, Any] = {k: d.get(k) for k in cls.__dataclass_fields__}
        return cls(**values)


@dataclass(frozen=True)
class LogChunk:
    """A piece of a task's output: `raw` the bytes exactly as written, `data` them as text."""

    id: int
    attempt: int
    stream: str
    data: str
    raw: bytes = field(default=b"", repr=False)

    @classmethod
    def of(cls, c: dict[str, Any]) -> LogChunk:
        raw = base64.b64decode(c["data"])
        return cls(c["id"], c["attempt"], c["stream"], raw.decode("utf-8", errors="replace"), raw)


@dataclass(frozen=True)
class TaskEnd:
    """How a followed task ended: its state, exit code and reason sentence."""

    state: str
    exit_code: int | None
    reason: str | None


@dataclass(frozen=True)
class RunResult:
    task: Task
    exit_code: int | None
    output: str

    @property
    def ok(self) -> bool:
        return self.task.state == "succeeded"


class Page(list[T]):
    """Rows of a paged listing, and how many follow them: "0", an exact number, or "10000+"."""

    remaining: str = "0"


# ---- the request specs: each endpoint once -----------------------------------------------------


@dataclass
class Call(Generic[T]):
    """One request and how to read its answer (the JSON body, None for a 204)."""

    method: str
    path: str
    read: Callable[[Any], T]
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] | None = None


def _q(ref: str) -> str:
    """A user's id, prefix or name as one path segment: whatever they typed stays one argument."""
    return quote(ref, safe="")


def _same(d: Any) -> Any:
    return d


def _if_match(revision: int | None) -> dict[str, str] | None:
    return {"If-Match": f'"{revision}"'} if revision is not None else None


def _body(command: list[str] | None, spec: dict[str, Any] | None, idempotency_key: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    body = dict(spec or {})
    if command is not None:
        body["command"] = list(command)
    body.update(fields)
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    return body


def _submitted(d: Any) -> Task:
    return Task.of(d["task"], d.get("created"))


class _api:  # noqa: N801 - a namespace of request specs, not a class one makes
    @staticmethod
    def submit(body: dict[str, Any]) -> Call[Task]:
        return Call("POST", "/v1/tasks", _submitted, json=body)

    @staticmethod
    def submit_many(specs: list[dict[str, Any]]) -> Call[list[Task]]:
        return Call("POST", "/v1/tasks/batch", lambda d: [Task.of(r["task"]) for r in d], json={"tasks": specs})

    @staticmethod
    def check(body: dict[str, Any]) -> Call[dict[str, Any]]:
        return Call("POST", "/v1/tasks/check", _same, json=body)

    @staticmethod
    def task(ref: str) -> Call[Task]:
        return Call("GET", f"/v1/tasks/{_q(ref)}", Task.of)

    @staticmethod
    def cancel(ref: str, if_revision: int | None) -> Call[Task]:
        return Call("POST", f"/v1/tasks/{_q(ref)}/cancel", Task.of, headers=_if_match(if_revision))

    @staticmethod
    def explain(ref: str) -> Call[dict[str, Any]]:
        return Call("GET", f"/v1/tasks/{_q(ref)}/explain", _same)

    @staticmethod
    def node(ref: str) -> Call[Node]:
        return Call("GET", f"/v1/nodes/{_q(ref)}", Node.of)

    @staticmethod
    def node_events(ref: str, after: int) -> Call[list[dict[str, Any]]]:
        return Call("GET", f"/v1/nodes/{_q(ref)}/events", _same, params={"after": after})

    @staticmethod
    def drain(ref: str, draining: bool, deadline: str | None) -> Call[Node]:
        params = {"deadline": deadline} if draining and deadline is not None else None
        return Call("POST", f"/v1/nodes/{_q(ref)}/{'drain' if draining else 'undrain'}", Node.of, params=params)

    @staticmethod
    def set_labels(ref: str, labels: dict[str, str], if_revision: int | None) -> Call[Node]:
        return Call("PUT", f"/v1/nodes/{_q(ref)}/labels", Node.of, json={"labels": labels}, headers=_if_match(if_revision))

    @staticmethod
    def revoke_node(ref: str) -> Call[Node]:
        return Call("POST", f"/v1/nodes/{_q(ref)}/revoke", Node.of)

    @staticmethod
    def put_spec(name: str, spec: dict[str, Any]) -> Call[dict[str, Any]]:
        return Call("PUT", f"/v1/specs/{_q(name)}", _same, json=spec)

    @staticmethod
    def spec(name: str, revision: int | None) -> Call[dict[str, Any]]:
        return Call("GET", f"/v1/specs/{_q(name)}", _same, params={"revision": revision} if revision else None)

    @staticmethod
    def specs() -> Call[list[dict[str, Any]]]:
        return Call("GET", "/v1/specs", _same)

    @staticmethod
    def submit_spec(name: str, revision: int | None, idempotency_key: str | None) -> Call[Task]:
        body = {k: v for k, v in {"revision": revision, "idempotency_key": idempotency_key}.items() if v is not None}
        return Call("POST", f"/v1/specs/{_q(name)}/submit", _submitted, json=body)

    @staticmethod
    def create_token(name: str, role: str) -> Call[dict[str, Any]]:
        return Call("POST", "/v1/tokens", _same, json={"name": name, "role": role})

    @staticmethod
    def tokens() -> Call[list[dict[str, Any]]]:
        return Call("GET", "/v1/tokens", _same)

    @staticmethod
    def revoke_token(token_id: str) -> Call[dict[str, Any]]:
        return Call("DELETE", f"/v1/tokens/{_q(token_id)}", _same)

    @staticmethod
    def set_secret(name: str, value: str) -> Call[dict[str, Any]]:
        return Call("PUT", f"/v1/secrets/{_q(name)}", _same, json={"value": value})

    @staticmethod
    def secrets() -> Call[list[dict[str, Any]]]:
        return Call("GET", "/v1/secrets", _same)

    @staticmethod
    def delete_secret(name: str) -> Call[None]:
        return Call("DELETE", f"/v1/secrets/{_q(name)}", _same)

    @staticmethod
    def registry_login(host: str, username: str, password: str) -> Call[dict[str, Any]]:
        return Call("PUT", f"/v1/registries/{_q(host)}", _same, json={"username": username, "password": password})


def _error_of(r: httpx.Response) -> PodiumError:
    try:
        msg = r.json().get("error") or r.text
    except (json.JSONDecodeError, AttributeError):
        msg = r.text or r.reason_phrase
    return PodiumError(str(msg), r.status_code)


def _answer(call: Call[T], r: httpx.Response) -> T:
    if r.status_code >= 400:
        raise _error_of(r)
    return call.read(None if r.status_code == 204 else r.json())


def _unreachable(addr: str, e: Exception) -> PodiumError:
    """A transport failure as one sentence that says what to check."""
    if isinstance(e, httpx.ConnectError):
        return PodiumError(f"cannot reach the Podium server at {addr}; is it running? "
                           "(`podium dev` starts one; PODIUM_ADDR or the CLI's --server point elsewhere)")  # fmt: skip
    if isinstance(e, httpx.TimeoutException):
        return PodiumError(f"the Podium server at {addr} did not answer in time")
    if isinstance(e, ssl.SSLError):
        return PodiumError(f"TLS with {addr} failed: {e} (PODIUM_CA_FILE names the CA to trust)")
    return PodiumError(f"talking to {addr} failed: {e}")


_TRANSPORT = (httpx.HTTPError, ssl.SSLError)


class _Overload:
    """How long a request the server refused as overloaded (429: nothing stored) is sent again."""

    def __init__(self, patience: float, on_wait: Callable[[], None] | None) -> None:
        self.give_up = time.monotonic() + patience
        self.on_wait = on_wait
        self.told = False

    def wait(self, r: httpx.Response) -> float | None:
        """Seconds to wait before sending again, or None to take this answer."""
        if r.status_code != 429 or time.monotonic() >= self.give_up:
            return None
        if not self.told and self.on_wait is not None:
            self.on_wait()
        self.told = True
        try:
            after = float(r.headers.get("Retry-After", "1"))
        except ValueError:
            after = 1.0
        return min(10.0, max(0.1, after))


class _Pager(Generic[T]):
    """Up to `limit` rows (all with None) of a paged listing, following its `Link: rel="next"`
    pages; the last request asks how many rows remain after it."""

    def __init__(self, path: str, limit: int | None, read: Callable[[Any], T], params: dict[str, Any]) -> None:
        self.url = path
        self.limit = limit
        self.read = read
        self.query: dict[str, Any] = {k: v for k, v in params.items() if v is not None}
        self.rows: Page[T] = Page()
        self.done = False
        self._last = False

    def call(self) -> Call[Any]:
        want = PAGE if self.limit is None else min(PAGE, self.limit - len(self.rows))
        self._last = self.limit is not None and want == self.limit - len(self.rows)
        params = {**self.query, "limit": want, **({"count": "true"} if self._last else {})}
        return Call("GET", self.url, _same, params=params)

    def feed(self, r: httpx.Response) -> None:
        if r.status_code >= 400:
            raise _error_of(r)
        self.rows.extend(self.read(d) for d in r.json())
        nxt = r.links.get("next", {}).get("url")
        if nxt is None:
            self.done = True
        elif self._last:
            self.rows.remaining = r.headers.get("Podium-Remaining", "1")
            self.done = True
        else:
            # the next page's URL carries the filters and the cursor (httpx's `params` would replace
            # its query, not add to it: so the query is taken apart here)
            link = httpx.URL(nxt)
            self.url, self.query = link.path, dict(link.params)


class _LogPages:
    """A task's output so far, page by page from the cursor of the last chunk read, as bytes."""

    def __init__(self, ref: str) -> None:
        self.path = f"/v1/tasks/{_q(ref)}/logs"
        self.cursor: str | None = None
        self.done = False

    def call(self) -> Call[Any]:
        return Call("GET", self.path, _same, params={"encoding": "base64", **({"cursor": self.cursor} if self.cursor else {})})

    def feed(self, page: dict[str, Any]) -> list[LogChunk]:
        self.done = not page["chunks"]
        self.cursor = page["next_cursor"] or self.cursor
        return [LogChunk.of(c) for c in page["chunks"]]


class _Stream:
    """One server-sent event stream and where its reader is in it: the last id delivered (sent back
    as Last-Event-ID when it reconnects), the event being parsed, and how long to keep trying."""

    def __init__(self, addr: str, path: str, params: dict[str, str], last_id: str | None,
                 on_open: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.addr, self.path, self.params, self.last_id = addr, path, params, last_id
        self.on_open = on_open
        self.cur: dict[str, str] = {}
        self.give_up: float | None = None
        self.ended = False

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": self.last_id} if self.last_id else {}

    def opened(self, r: httpx.Response) -> bool:
        """True if the stream is open; False if the server is not ready yet (retry); raises a refusal."""
        if r.status_code == 503:
            return False
        if r.status_code >= 400:
            raise _error_of(r)
        self.give_up = None
        self.cur = {}
        if self.on_open is not None:
            self.on_open()
        return True

    def feed(self, line: str) -> tuple[str, str] | None:
        """(event name, data) once an event is complete; an `end` event ends the stream."""
        if line == "":
            cur, self.cur = self.cur, {}
            if "data" not in cur:
                return None
            if cur.get("id"):
                self.last_id = cur["id"]
            name = cur.get("event", "message")
            self.ended = name == "end"
            return name, cur["data"]
        if line.startswith(":"):
            return None
        k, _, v = line.partition(":")
        v = v[1:] if v.startswith(" ") else v
        self.cur[k] = self.cur[k] + "\n" + v if k == "data" and k in self.cur else v
        return None

    def lost(self) -> float:
        """The connection ended before the stream did: seconds to wait before resuming."""
        now = time.monotonic()
        self.give_up = self.give_up or now + RECONNECT_SECONDS
        if now > self.give_up:
            raise PodiumError(f"lost the Podium server at {self.addr} and it did not come back")
        return 0.5


def _events_stream(addr: str, task: str | None, node: str | None, state: str | Iterable[str] | None, kind: str | None,
                   after: int | None, on_open: Callable[[], None] | None) -> _Stream:  # fmt: skip
    states = state if state is None or isinstance(state, str) else ",".join(state)
    params = {k: v for k, v in (("task", task), ("node", node), ("state", states), ("kind", kind)) if v}
    return _Stream(addr, "/v1/events", params, None if after is None else str(after), on_open)


def _log_stream(addr: str, ref: str) -> _Stream:
    return _Stream(addr, f"/v1/tasks/{_q(ref)}/logs/stream", {"encoding": "base64"}, None)


def _log_item(name: str, data: str) -> LogChunk | TaskEnd | None:
    if name == "chunk":
        return LogChunk.of(json.loads(data))
    if name == "end":
        e = json.loads(data)
        return TaskEnd(e["state"], e.get("exit_code"), e.get("reason"))
    return None


# ---- the two transports ------------------------------------------------------------------------


class Client:
    """The synchronous client. `Client()` finds the server and token as the CLI does.

    `overload_patience`: for how many seconds a request the server refused as overloaded (429,
    nothing stored) is sent again as the server asks; `on_overload` is called once when it first is."""

    def __init__(self, addr: str | None = None, token: str | None = None, timeout: float = 30.0,
                 overload_patience: float = 0.0, on_overload: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.addr, headers, verify = _settings(addr, token)
        self.http = httpx.Client(base_url=self.addr, timeout=timeout, headers=headers, verify=verify)
        self._patience, self._on_overload = overload_patience, on_overload

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(self, call: Call[Any]) -> httpx.Response:
        overload = _Overload(self._patience, self._on_overload)
        while True:
            try:
                r = self.http.request(call.method, call.path, params=call.params, json=call.json, headers=call.headers)
            except _TRANSPORT as e:
                raise _unreachable(self.addr, e) from None
            wait = overload.wait(r)
            if wait is None:
                return r
            time.sleep(wait)

    def _do(self, call: Call[T]) -> T:
        return _answer(call, self._send(call))

    def _pages(self, pager: _Pager[T]) -> Page[T]:
        while not pager.done:
            pager.feed(self._send(pager.call()))
        return pager.rows

    def _stream(self, s: _Stream) -> Iterator[tuple[str, str]]:
        """Server-sent events, resuming after the last id seen if the connection drops."""
        while not s.ended:
            try:
                with self.http.stream("GET", s.path, params=s.params, headers=s.headers(), timeout=_STREAM_TIMEOUT) as r:
                    if r.status_code >= 400:
                        r.read()
                    if s.opened(r):
                        for line in r.iter_lines():
                            ev = s.feed(line)
                            if ev is not None:
                                yield ev
                                if s.ended:
                                    return
            except _TRANSPORT:
                pass
            time.sleep(s.lost())

    # -- tasks
    def submit(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None,
               idempotency_key: str | None = None, **fields: Any) -> Task:  # fmt: skip
        """Submit a task: a command and any spec fields (name, resources, labels, …)."""
        return self._do(_api.submit(_body(command, spec, idempotency_key, fields)))

    def check(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Could any node of the fleet ever run this spec, and why not each node; stores nothing."""
        return self._do(_api.check(spec))

    def tasks(self, *, state: str | None = None, node: str | None = None, name: str | None = None,
              limit: int | None = 100) -> Page[Task]:  # fmt: skip
        """Tasks, newest first: up to `limit` (all with None); `.remaining` says how many follow."""
        return self._pages(_Pager("/v1/tasks", limit, Task.of, {"state": state, "node": node, "name": name}))

    def submit_many(self, specs: list[dict[str, Any]]) -> list[Task]:
        """Submit up to 1,000 task specs in one transaction: all are stored, or none. In their order."""
        return self._do(_api.submit_many(specs))

    def task(self, task_id: str) -> Task:
        return self._do(_api.task(task_id))

    def cancel(self, task_id: str, if_revision: int | None = None) -> Task:
        return self._do(_api.cancel(task_id, if_revision))

    def explain(self, task_id: str) -> dict[str, Any]:
        return self._do(_api.explain(task_id))

    def logs(self, task_id: str, *, follow: bool = False) -> Iterator[LogChunk]:
        """A task's output; with follow=True, as it is written, until the task ends."""
        for item in self.follow(task_id) if follow else self._log_pages(task_id):
            if isinstance(item, LogChunk):
                yield item

    def _log_pages(self, task_id: str) -> Iterator[LogChunk]:
        pages = _LogPages(task_id)
        while True:
            chunks = pages.feed(self._do(pages.call()))
            if pages.done:
                return
            yield from chunks

    def follow(self, task_id: str) -> Iterator[LogChunk | TaskEnd]:
        """A task's output as it is written, in order, none twice (across reconnects and server
        restarts), then how it ended."""
        for name, data in self._stream(_log_stream(self.addr, task_id)):
            item = _log_item(name, data)
            if item is not None:
                yield item

    def events(self, *, task: str | None = None, node: str | None = None, state: str | Iterable[str] | None = None,
               kind: str | None = None, after: int | None = None, on_open: Callable[[], None] | None = None,
               ) -> Iterator[Event]:  # fmt: skip
        """Task and node events from now on (or after event id `after`), forever. `state` keeps only task
        events into that state, or into any of several (`("running", "succeeded")`). `on_open` is called
        each time the stream is open (again): every event after that moment will be delivered."""
        for _name, data in self._stream(_events_stream(self.addr, task, node, state, kind, after, on_open)):
            yield Event.of(json.loads(data))

    def run(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None, **fields: Any) -> RunResult:
        """Submit a task, wait for it to end, and return its exit code and output."""
        task = self.submit(command, spec=spec, **fields)
        output = b"".join(c.raw for c in self.logs(task.id, follow=True)).decode("utf-8", errors="replace")
        final = self.task(task.id)
        return RunResult(final, final.exit_code, output)

    # -- named specs
    def put_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self._do(_api.put_spec(name, spec))

    def spec(self, name: str, revision: int | None = None) -> dict[str, Any]:
        return self._do(_api.spec(name, revision))

    def specs(self) -> list[dict[str, Any]]:
        return self._do(_api.specs())

    def submit_spec(self, name: str, revision: int | None = None, idempotency_key: str | None = None) -> Task:
        return self._do(_api.submit_spec(name, revision, idempotency_key))

    # -- nodes
    def nodes(self, limit: int | None = None) -> Page[Node]:
        return self._pages(_Pager("/v1/nodes", limit, Node.of, {}))

    def node(self, node: str) -> Node:
        return self._do(_api.node(node))

    def node_events(self, node: str, after: int = 0) -> list[dict[str, Any]]:
        return self._do(_api.node_events(node, after))

    def drain(self, node: str, draining: bool = True, deadline: str | None = None) -> Node:
        return self._do(_api.drain(node, draining, deadline))

    def set_labels(self, node: str, labels: dict[str, str], if_revision: int | None = None) -> Node:
        return self._do(_api.set_labels(node, labels, if_revision))

    def revoke_node(self, node: str) -> Node:
        return self._do(_api.revoke_node(node))

    # -- identities, secrets, audit
    def create_token(self, name: str, role: str) -> dict[str, Any]:
        return self._do(_api.create_token(name, role))

    def tokens(self) -> list[dict[str, Any]]:
        return self._do(_api.tokens())

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        return self._do(_api.revoke_token(token_id))

    def set_secret(self, name: str, value: str) -> dict[str, Any]:
        return self._do(_api.set_secret(name, value))

    def secrets(self) -> list[dict[str, Any]]:
        return self._do(_api.secrets())

    def delete_secret(self, name: str) -> None:
        self._do(_api.delete_secret(name))

    def registry_login(self, host: str, username: str, password: str) -> dict[str, Any]:
        return self._do(_api.registry_login(host, username, password))

    def audit(self, limit: int | None = 100) -> Page[dict[str, Any]]:
        return self._pages(_Pager("/v1/audit", limit, _same, {}))


class AsyncClient:
    """The asynchronous client; the same calls as `Client`, awaited (streams are async iterators)."""

    def __init__(self, addr: str | None = None, token: str | None = None, timeout: float = 30.0,
                 overload_patience: float = 0.0, on_overload: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.addr, headers, verify = _settings(addr, token)
        self.http = httpx.AsyncClient(base_url=self.addr, timeout=timeout, headers=headers, verify=verify)
        self._patience, self._on_overload = overload_patience, on_overload

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _send(self, call: Call[Any]) -> httpx.Response:
        import asyncio  # here, not at the top: a sync Client's program (the CLI) need not load it

        overload = _Overload(self._patience, self._on_overload)
        while True:
            try:
                r = await self.http.request(call.method, call.path, params=call.params, json=call.json, headers=call.headers)
            except _TRANSPORT as e:
                raise _unreachable(self.addr, e) from None
            wait = overload.wait(r)
            if wait is None:
                return r
            await asyncio.sleep(wait)

    async def _do(self, call: Call[T]) -> T:
        return _answer(call, await self._send(call))

    async def _pages(self, pager: _Pager[T]) -> Page[T]:
        while not pager.done:
            pager.feed(await self._send(pager.call()))
        return pager.rows

    async def _stream(self, s: _Stream) -> AsyncIterator[tuple[str, str]]:
        import asyncio  # as in _send

        while not s.ended:
            try:
                async with self.http.stream("GET", s.path, params=s.params, headers=s.headers(), timeout=_STREAM_TIMEOUT) as r:
                    if r.status_code >= 400:
                        await r.aread()
                    if s.opened(r):
                        async for line in r.aiter_lines():
                            ev = s.feed(line)
                            if ev is not None:
                                yield ev
                                if s.ended:
                                    return
            except _TRANSPORT:
                pass
            await asyncio.sleep(s.lost())

    # -- tasks
    async def submit(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None,
                     idempotency_key: str | None = None, **fields: Any) -> Task:  # fmt: skip
        return await self._do(_api.submit(_body(command, spec, idempotency_key, fields)))

    async def submit_many(self, specs: list[dict[str, Any]]) -> list[Task]:
        return await self._do(_api.submit_many(specs))

    async def check(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self._do(_api.check(spec))

    async def tasks(self, *, state: str | None = None, node: str | None = None, name: str | None = None,
                    limit: int | None = 100) -> Page[Task]:  # fmt: skip
        return await self._pages(_Pager("/v1/tasks", limit, Task.of, {"state": state, "node": node, "name": name}))

    async def task(self, task_id: str) -> Task:
        return await self._do(_api.task(task_id))

    async def cancel(self, task_id: str, if_revision: int | None = None) -> Task:
        return await self._do(_api.cancel(task_id, if_revision))

    async def explain(self, task_id: str) -> dict[str, Any]:
        return await self._do(_api.explain(task_id))

    async def logs(self, task_id: str, *, follow: bool = False) -> AsyncIterator[LogChunk]:
        if follow:
            async for item in self.follow(task_id):
                if isinstance(item, LogChunk):
                    yield item
            return
        pages = _LogPages(task_id)
        while True:
            chunks = pages.feed(await self._do(pages.call()))
            if pages.done:
                return
            for c in chunks:
                yield c

    async def follow(self, task_id: str) -> AsyncIterator[LogChunk | TaskEnd]:
        async for name, data in self._stream(_log_stream(self.addr, task_id)):
            item = _log_item(name, data)
            if item is not None:
                yield item

    async def events(self, *, task: str | None = None, node: str | None = None, state: str | Iterable[str] | None = None,
                     kind: str | None = None, after: int | None = None, on_open: Callable[[], None] | None = None,
                     ) -> AsyncIterator[Event]:  # fmt: skip
        async for _name, data in self._stream(_events_stream(self.addr, task, node, state, kind, after, on_open)):
            yield Event.of(json.loads(data))

    async def run(self, command: list[str] | None = None, *, spec: dict[str, Any] | None = None, **fields: Any) -> RunResult:
        task = await self.submit(command, spec=spec, **fields)
        output = b"".join([c.raw async for c in self.logs(task.id, follow=True)]).decode("utf-8", errors="replace")
        final = await self.task(task.id)
        return RunResult(final, final.exit_code, output)

    # -- named specs
    async def put_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return await self._do(_api.put_spec(name, spec))

    async def spec(self, name: str, revision: int | None = None) -> dict[str, Any]:
        return await self._do(_api.spec(name, revision))

    async def specs(self) -> list[dict[str, Any]]:
        return await self._do(_api.specs())

    async def submit_spec(self, name: str, revision: int | None = None, idempotency_key: str | None = None) -> Task:
        return await self._do(_api.submit_spec(name, revision, idempotency_key))

    # -- nodes
    async def nodes(self, limit: int | None = None) -> Page[Node]:
        return await self._pages(_Pager("/v1/nodes", limit, Node.of, {}))

    async def node(self, node: str) -> Node:
        return await self._do(_api.node(node))

    async def node_events(self, node: str, after: int = 0) -> list[dict[str, Any]]:
        return await self._do(_api.node_events(node, after))

    async def drain(self, node: str, draining: bool = True, deadline: str | None = None) -> Node:
        return await self._do(_api.drain(node, draining, deadline))

    async def set_labels(self, node: str, labels: dict[str, str], if_revision: int | None = None) -> Node:
        return await self._do(_api.set_labels(node, labels, if_revision))

    async def revoke_node(self, node: str) -> Node:
        return await self._do(_api.revoke_node(node))

    # -- identities, secrets, audit
    async def create_token(self, name: str, role: str) -> dict[str, Any]:
        return await self._do(_api.create_token(name, role))

    async def tokens(self) -> list[dict[str, Any]]:
        return await self._do(_api.tokens())

    async def revoke_token(self, token_id: str) -> dict[str, Any]:
        return await self._do(_api.revoke_token(token_id))

    async def set_secret(self, name: str, value: str) -> dict[str, Any]:
        return await self._do(_api.set_secret(name, value))

    async def secrets(self) -> list[dict[str, Any]]:
        return await self._do(_api.secrets())

    async def delete_secret(self, name: str) -> None:
        await self._do(_api.delete_secret(name))

    async def registry_login(self, host: str, username: str, password: str) -> dict[str, Any]:
        return await self._do(_api.registry_login(host, username, password))

    async def audit(self, limit: int | None = 100) -> Page[dict[str, Any]]:
        return await self._pages(_Pager("/v1/audit", limit, _same, {}))
