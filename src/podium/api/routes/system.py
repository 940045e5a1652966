"""The server itself: liveness (`/healthz`) and Prometheus metrics (`/metrics`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from podium.api.deps import Viewer
from podium.api.models import ErrorOut

router = APIRouter()


@router.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    return "ok"


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={c: {"model": ErrorOut, "content": {"application/json": {}}} for c in (401, 403, 503)},
)
async def metrics(_who: Viewer) -> PlainTextResponse:
    return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)
