"""The nemesis's slow disk is real: the campaign's own PostgreSQL, throttled by the kernel's block
layer, cannot commit faster than the disk it is given, and healing lifts the limit and leaves nothing.

Select it with `-m nemesis` (it needs root and a writable blkio controller)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import asyncpg
import pytest

from tests.nemesis.disk import BLKIO, SlowDisk, unavailable
from tests.nemesis.pg import OwnPostgres

_why = unavailable(Path(os.environ.get("TMPDIR", "/tmp"))) if os.geteuid() == 0 else "not root"
pytestmark = [pytest.mark.nemesis, pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(_why is not None, reason=f"no slow disk here: {_why}")]  # fmt: skip

COMMITS = 12
IOPS = 4  # each commit flushes the WAL: at least one write the throttle counts


async def _commits(url: str, n: int) -> float:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS t (i int)")
        t0 = time.monotonic()
        for i in range(n):
            await conn.execute("INSERT INTO t VALUES ($1)", i)  # its own transaction: a WAL flush each
        return time.monotonic() - t0
    finally:
        await conn.close()


def test_a_slow_disk_holds_postgresql_to_its_rate_and_heals() -> None:
    pg = OwnPostgres(log=lambda _s: None).start()
    disk: SlowDisk | None = None
    try:
        assert pg.emb is not None and pg.emb._server is not None
        disk = SlowDisk(Path(pg.emb._server.pgdata))
        asyncio.run(_commits(pg.admin_url, 2))  # warm: the table, the connection's first steps
        assert disk.slow(iops=IOPS, bps=1 << 20) >= 3  # the postmaster and its helpers at least
        slow = asyncio.run(_commits(pg.admin_url, COMMITS))
        # a lower bound, whatever the machine's speed: COMMITS flushes at IOPS a second (the first
        # second's worth may pass at once)
        assert slow >= (COMMITS - IOPS) / IOPS * 0.8, f"{COMMITS} commits in {slow:.2f}s under {IOPS} I/Os a second"
        disk.heal()
        for name in ("read_iops_device", "write_iops_device", "read_bps_device", "write_bps_device"):
            assert (disk.group / f"blkio.throttle.{name}").read_text().strip() == ""
        asyncio.run(_commits(pg.admin_url, COMMITS))  # commits again, unthrottled
        disk.remove()
        assert not disk.group.exists()
        assert not [g for g in BLKIO.iterdir() if g.name == disk.group.name]
    finally:
        if disk is not None:
            disk.remove()
        pg.stop()
