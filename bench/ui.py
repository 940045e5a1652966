"""Issue-15 figures: the UI's tasks page with 1,000,000 tasks stored (time to first byte of the
first page and of a keyset page deep in the list), and the server CPU that 1,000 idle event-stream
clients cost.

    .venv/bin/python bench/ui.py [--tasks 1000000] [--clients 1000] [--idle 30] [--db postgresql://…]

Uses the system PostgreSQL (a fresh database, dropped afterwards) unless --db is given. The million
tasks are inserted by one SQL statement (they are finished tasks with an event each); the server is a
real `python -m podium server` process; CPU is the server process's user+system time over an idle
window, read with psutil, with no clients and then with the clients connected.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import Server  # noqa: E402

FILL = """
INSERT INTO tasks (id, name, spec, state, reason, priority, cpu_millis, memory_bytes, max_attempts, requeue_on_node_loss,
                   attempts, exit_code, created_at, updated_at, finished_at)
SELECT gen_random_uuid(), 'bench-' || (g % 100), '{"command": ["true"], "labels": {}}'::jsonb,
       CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN g % 10 = 0 THEN 'the task exited with a non-zero code' END, 0, 100, 67108864, 3, true,
       1, CASE WHEN g % 10 = 0 THEN 1 ELSE 0 END,
       now() - make_interval(secs => ($1 - g) * 0.01), now(), now()
FROM generate_series(1, $1) g
"""


async def prepare(admin_url: str, name: str, tasks: int) -> str:
    c = await asyncpg.connect(admin_url)
    await c.execute(f'DROP DATABASE IF EXISTS "{name}"')
    await c.execute(f'CREATE DATABASE "{name}"')
    await c.close()
    url = re.sub(r"/[^/]*$", f"/{name}", admin_url)
    from podium.store import Store

    s = await Store.connect(url)
    await s.migrate()
    await s.close()
    c = await asyncpg.connect(url)
    t = time.monotonic()
    await c.execute(FILL, tasks)
    await c.execute("ANALYZE tasks")
    print(f"inserted {tasks:,} tasks in {time.monotonic() - t:.1f}s")
    await c.close()
    return url


async def drop(admin_url: str, name: str) -> None:
    c = await asyncpg.connect(admin_url)
    await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await c.close()


def sign_in(base: str, token: str) -> httpx.Client:
    c = httpx.Client(base_url=base, follow_redirects=False, timeout=30)
    csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/signin").text).group(1)  # type: ignore[union-attr]
    assert c.post("/signin", data={"token": token, "csrf": csrf}).status_code == 303
    return c


def ttfb(c: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    with c.stream("GET", url) as r:
        next(r.iter_raw())
        first = time.perf_counter() - t
        assert r.status_code == 200, r.status_code
    return first


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def open_clients(port: int, cookie: str, n: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {cookie}\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())  # fmt: skip
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n", 1)[0], head
        writers.append(writer)
    return writers


def cpu_share(proc: psutil.Process, seconds: float) -> float:
    a = proc.cpu_times()
    time.sleep(seconds)
    b = proc.cpu_times()
    return ((b.user - a.user) + (b.system - a.system)) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--db", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # the server inherits it
    name = f"podium_bench_ui_{os.getpid()}"
    url = asyncio.run(prepare(args.db, name, args.tasks))
    print(f"load average at start: {os.getloadavg()}")
    try:
        with tempfile.TemporaryDirectory() as d:
            server = Server(Path(d), url).start()
            try:
                token = server.admin_token
                c = sign_in(server.api, token)
                c.get("/")  # warm
                first = [ttfb(c, "/") for _ in range(args.runs)]
                # a keyset position deep in the list: the 900,000th newest task
                deep = asyncio.run(_position(url, int(args.tasks * 0.9)))
                deep_url = f"/?before={deep}"
                page = [ttfb(c, deep_url) for _ in range(args.runs)]
                filtered = [ttfb(c, f"/?state=failed&before={deep}") for _ in range(args.runs)]
                print(f"tasks page, first byte, first page: median {statistics.median(first)*1000:.1f} ms, "
                      f"p95 {pct(first, .95)*1000:.1f} ms")  # fmt: skip
                print(f"tasks page, first byte, keyset page at 90%: median {statistics.median(page)*1000:.1f} ms, "
                      f"p95 {pct(page, .95)*1000:.1f} ms")  # fmt: skip
                print(f"tasks page, first byte, state=failed keyset page at 90%: median "
                      f"{statistics.median(filtered)*1000:.1f} ms, p95 {pct(filtered, .95)*1000:.1f} ms")  # fmt: skip
                proc = psutil.Process(server.pid)
                base = cpu_share(proc, args.idle)
                print(f"server CPU idle, no stream clients: {base:.3f} core")

                async def hold() -> float:
                    writers = await open_clients(server.port, token, args.clients)
                    await asyncio.sleep(2)
                    share = await asyncio.to_thread(cpu_share, proc, args.idle)
                    for w in writers:
                        w.close()
                    return share

                with_clients = asyncio.run(hold())
                print(f"server CPU idle, {args.clients} stream clients: {with_clients:.3f} core "
                      f"(+{with_clients - base:.3f})")  # fmt: skip
            finally:
                server.stop()
    finally:
        print(f"load average at end: {os.getloadavg()}")
        asyncio.run(drop(args.db, name))


async def _position(url: str, offset: int) -> str:
    c = await asyncpg.connect(url)
    r = await c.fetchrow("SELECT created_at, id FROM tasks ORDER BY created_at DESC, id DESC OFFSET $1 LIMIT 1", offset)
    await c.close()
    return f"{r['created_at'].isoformat()}_{r['id']}".replace("+", "%2B")


if __name__ == "__main__":
    main()
