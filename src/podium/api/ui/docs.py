"""The API docs, served with the vendored Swagger UI so they work without the internet (FastAPI's
own /docs loads Swagger UI from a public CDN). The page has no inline script: its start-up code is a
static file, so no inline script runs (Swagger UI sets styles inline, so styles may be inline here). ReDoc is not served."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Podium API</title>
<link rel="icon" type="image/png" href="/ui/static/vendor/swagger-ui/favicon-32x32.png">
<link rel="stylesheet" href="/ui/static/vendor/swagger-ui/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/ui/static/vendor/swagger-ui/swagger-ui-bundle.js"></script>
<script src="/ui/static/swagger-init.js"></script>
</body>
</html>
"""


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return HTMLResponse(_PAGE, headers={"Content-Security-Policy": CSP})

    return r
