"""Paging: the convention every list endpoint follows (docs/decisions.md, "Paging").

`?limit=N` rows, newest (or first) first in a stable order; when more follow, the answer carries
`Link: <same path and filters, after=CURSOR>; rel="next"`. The cursor is opaque (base64url JSON of
the last row's sort key, tagged with its listing) and good for as long as the rows exist: paging
is a keyset range scan from it, never OFFSET, so page 1,000 costs what page 1 does. `count=true`
adds `Podium-Remaining`: how many rows follow the page, counted up to REMAINING_CAP ("10000+" past it).
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from fastapi import Request, Response

from podium.api.models import ErrorOut
from podium.errors import InvalidRequest

REMAINING_CAP = 10_000
AFTER_DOC = "the cursor from the previous page's `Link: rel=\"next\"` header; omit it for the first page"
COUNT_DOC = f"add a `Podium-Remaining` header: how many rows follow this page (up to {REMAINING_CAP:,}, then `{REMAINING_CAP}+`)"
PAGE_HEADERS = {
    "Link": {"description": 'the next page, `<URL>; rel="next"`; absent on the last page', "schema": {"type": "string"}},
    "Podium-Remaining": {"description": "with count=true: how many rows follow this page", "schema": {"type": "string"}},
}
# The error answers every /v1/ route documents.
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorOut} for code in (400, 401, 403, 404, 409, 413, 422, 503)}
PAGED = {**ERRORS, 200: {"headers": PAGE_HEADERS}}


def cursor(kind: str, *key: Any) -> str:
    raw = json.dumps([kind, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def uncursor(kind: str, after: str | None, types: tuple[type, ...]) -> list[Any] | None:
    """The sort key a cursor holds, or a 422 naming `after` if it is not one this listing gave out."""
    if after is None:
        return None
    bad = InvalidRequest(
        f"after: {after[:80]!r} is not a cursor of this listing; pass the one from the previous page's "
        'Link: rel="next" header, or omit `after` for the first page'
    )
    try:
        key = json.loads(base64.urlsafe_b64decode(after + "=" * (-len(after) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(key, list) or len(key) != len(types) + 1 or key[0] != kind:
        raise bad
    out: list[Any] = []
    try:
        for value, typ in zip(key[1:], types, strict=True):
            if typ is int:
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                    raise ValueError
                out.append(value)
            elif not isinstance(value, str) or len(value) > 256 or "\x00" in value:
                raise ValueError
            else:
                value.encode()  # a lone surrogate is no key of ours (UnicodeEncodeError is a ValueError)
                if typ is datetime:
                    at = datetime.fromisoformat(value)
                    if at.tzinfo is None:
                        raise ValueError
                    out.append(at)
                elif typ is uuid.UUID:
                    out.append(uuid.UUID(value))
                else:
                    out.append(value)
    except (ValueError, OverflowError):
        raise bad from None
    return out


def page(request: Request, response: Response, rows: list[Any], limit: int, key: Callable[[Any], str], remaining: int | None) -> list[Any]:
    """Trim the one row read beyond `limit` and, if there was one, point `Link` at the next page."""
    if len(rows) > limit:
        rows = rows[:limit]
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("after", "limit")]
        params += [("limit", str(limit)), ("after", key(rows[-1]))]
        response.headers["Link"] = f'<{request.url.path}?{urlencode(params)}>; rel="next"'
    if remaining is not None:
        response.headers["Podium-Remaining"] = f"{REMAINING_CAP}+" if remaining >= REMAINING_CAP else str(remaining)
    return rows
