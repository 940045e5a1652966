"""The embedded PostgreSQL runs with the settings a control plane's writes need (podium.store.embedded's
SETTINGS), and keeps an operator's own."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from podium.store.embedded import SETTINGS, EmbeddedPostgres


@pytest.fixture
def home() -> Iterator[Path]:
    # not under pytest's basetemp (see tests/conftest.py's embedded_pg)
    path = Path(tempfile.mkdtemp(prefix="podium-test-settings-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def settled(url: str, name: str, want: str, timeout: float = 30.0) -> str:
    """The setting as a new session sees it, once it is `want` (a reload is applied asynchronously),
    or as it is when `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        conn = await asyncpg.connect(url)
        try:
            got = str(await conn.fetchval(f"SHOW {name}"))
        finally:
            await conn.close()
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def test_the_embedded_server_runs_with_podiums_settings_and_keeps_an_operators(home: Path) -> None:
    emb = EmbeddedPostgres(home)
    url = await asyncio.to_thread(emb.start)
    try:
        await emb.ensure_database(url)
        for name, value in SETTINGS.items():
            assert await settled(url, name, value) == value, name
        # the operator's own value, set as PostgreSQL's documentation says
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("ALTER SYSTEM SET max_wal_size = '2GB'")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()
        assert await settled(url, "max_wal_size", "2GB") == "2GB"
    finally:
        await asyncio.to_thread(emb.stop)
    # a restart (each start looks again) keeps it, and the other settings
    emb = EmbeddedPostgres(home)
    url = await asyncio.to_thread(emb.start)
    try:
        await emb.ensure_database(url)
        # what the files say, which a reload applies (read from the files themselves: no waiting on one)
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch("SELECT name, setting FROM pg_file_settings WHERE sourcefile LIKE '%postgresql.auto.conf'")
        finally:
            await conn.close()
        assert dict((r["name"], r["setting"]) for r in rows) == {**SETTINGS, "max_wal_size": "2GB"}
        assert await settled(url, "max_wal_size", "2GB") == "2GB"
    finally:
        await asyncio.to_thread(emb.stop)
