"""Versioned SQL migrations: `migrations/NNNN_name.sql`, applied in order, each once, in a
transaction, under an advisory lock so several servers starting at once apply each exactly once."""

from __future__ import annotations

from importlib import resources

import asyncpg

_LOCK_KEY = 0x504F4449  # "PODI"


def migration_files() -> list[tuple[int, str, str]]:
    out = []
    for entry in resources.files("podium.store").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            out.append((version, entry.name, entry.read_text()))
    return sorted(out)


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply every migration not yet applied; return the names applied now."""
    applied_now: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migration_files():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name)
            applied_now.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied_now
