"""The first thing every request meets, before routing and before any body is parsed:

- a /v1/ call without an Authorization header is refused with 401 whatever its body, so an
  unauthenticated caller learns nothing from validation errors (the event streams also take the web
  UI's session cookie, checked by their route);
- a body is counted as it streams in (Content-Length or chunked alike) and refused past MAX_BODY;
- NUL characters are refused in the path, the query and the body: PostgreSQL text cannot hold them,
  and a request that would fail there must fail here with a sentence, not with a 500.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY = 1024 * 1024
# a JSON-escaped NUL (\u0000), not preceded by another backslash (which would make it literal text)
_ESCAPED_NUL = re.compile(rb"(?<!\\)\\u0000", re.IGNORECASE)


async def _reply(send: Send, status: int, error: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": error}).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def _nul_path(body: bytes) -> str:
    """Where in a JSON body the first NUL is, as the API names fields (`command.0`)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "body"

    def walk(value: Any, path: list[str]) -> list[str] | None:
        if isinstance(value, str):
            return path if "\x00" in value else None
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and "\x00" in key:
                return [*path, key.replace("\x00", "\\0")]
            found = walk(item, [*path, str(key)])
            if found is not None:
                return found
        return None

    found = walk(doc, [])
    return ".".join(found) if found else "body"


# The event streams a signed-in browser reads with its session cookie (an EventSource cannot send an
# Authorization header); the route itself checks the session (podium.api.session).
_SESSION_STREAMS = re.compile(r"^/v1/(events|tasks/[^/]+/logs/stream)$")


def _ui_stream(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    return scope.get("method") == "GET" and b"podium_session=" in headers.get(b"cookie", b"") and bool(
        _SESSION_STREAMS.match(scope["path"])
    )


class RequestGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["path"].startswith("/v1/") and not headers.get(b"authorization") and not _ui_stream(scope, headers):
            await _reply(send, 401, "this call needs a bearer token (Authorization: Bearer pdm_…; the CLI reads PODIUM_TOKEN)",
                         [(b"www-authenticate", b"Bearer")])  # fmt: skip
            return
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        if b"%00" in raw_path or b"%00" in query or "\x00" in scope["path"]:
            await _reply(send, 422, "the path or query contains a NUL character, which no name or id may hold")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
            await _reply(send, 413, f"the request body is larger than {MAX_BODY} bytes")
            return
        # Read the whole body now (it is at most MAX_BODY), then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                await _reply(send, 413, f"the request body is larger than {MAX_BODY} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if b"\x00" in body or _ESCAPED_NUL.search(body):
            await _reply(send, 422, f"{_nul_path(body)}: contains a NUL character, which no field may hold")
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
