"""Several Podium servers on one PostgreSQL: placement throughput and submit→assign latency with 1, 2
and 3 replicas on this machine, and the database's own commit rate for scale.

    .venv/bin/python bench/replicas.py [--replicas 1,2,3] [--tasks 2000] [--latency-tasks 1000]
                                       [--agents 8] [--slots 256] [--keep] [--out FILE]

For each replica count, on a fresh database of the system PostgreSQL 15 (PODIUM_BENCH_PG_URL, default
postgresql://postgres@127.0.0.1:5432/postgres), N real `podium server` processes share the database
(production timers: the accept deadline is 15s; dispatch is woken by NOTIFY, so the 1s tick does not
pace it), and `--agents` real `podium agent` processes with `--slots` slots each connect, agent i
listing replica i % N first and the others after it, so every replica holds streams. Then:

1. latency: `--latency-tasks` `true` tasks are POSTed round-robin over the replicas' APIs (32 in
   flight, each with an idempotency key) onto a fleet with room. Submit→assign latency per task is
   the `assigned` event's time minus the `queued` event's time, both written by the database clock
   (each is the now() of its transaction, i.e. the dispatch transaction's start: this slightly
   under-counts the time the placing transaction itself took);
2. placement throughput: every node is drained, `--tasks` tasks are queued behind them, every node is
   undrained at once, and placements per second are the backlog divided by the time (database clock)
   from just before the undrains until no task of it is queued, polled every 20 ms (fleet slots ≥
   tasks, so placement is not gated by completions; the agents start running them meanwhile). The number of
   dispatch transactions (distinct (replica, now()) among the events), who placed what
   (`scheduler:<server id>`), and PostgreSQL commits per task (pg_stat_database.xact_commit) come with it.
Then pgbench (`-N -c 4 -j 2 -T 10`, after `pgbench -i -s 1` in a scratch database on the same server,
with nothing of ours running) gives the commit rate the database sustains on its own.

Results: a table on stdout and bench/results/replicas.json. Real agents are used sparingly: 8 Python
processes (and their fence keepers) run every task; on a 2-core machine they are a large share of
the CPU, so these are figures for this machine with its fleet on it, not for the servers alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))  # the same real-process helpers the acceptance tests use
from tests import harness  # noqa: E402 - importable only once the line above put the repository on the path
from tests.harness import Agent, Server  # noqa: E402

PG_URL = os.environ.get("PODIUM_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PGBENCH = Path("/usr/lib/postgresql/15/bin/pgbench")
PGBENCH_DB = "podium_bench_pgbench"
PGBENCH_ARGS = ["-N", "-c", "4", "-j", "2", "-T", "10"]
TERMINAL = ["succeeded", "failed", "cancelled", "lost"]


def with_db(url: str, db: str) -> str:
    base, _, rest = url.partition("?")
    return f"{base.rpartition('/')[0]}/{db}" + (f"?{rest}" if rest else "")


async def admin(sql: str) -> None:
    conn = await asyncpg.connect(PG_URL)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def fetch(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def q(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    return asyncio.run(fetch(url, sql, *args))


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def auth(api: str) -> dict[str, str]:
    tok = getattr(harness, "ADMIN_TOKENS", {}).get(api)
    return {"Authorization": f"Bearer {tok}"} if tok else {}


async def submit(apis: list[str], n: int, tag: str, concurrency: int = 32) -> dict[str, Any]:
    clients = {a: httpx.AsyncClient(base_url=a, timeout=30, headers=auth(a)) for a in apis}
    sem = asyncio.Semaphore(concurrency)
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        body = {"command": ["true"], "idempotency_key": f"{tag}-{i}"}
        async with sem:
            for k in range(20):
                api = apis[(i + k) % len(apis)]
                try:
                    r = await clients[api].post("/v1/tasks", json=body)
                    if r.status_code in (200, 201):
                        return
                except httpx.TransportError:
                    pass
                errors += 1
                await asyncio.sleep(0.2)
            raise RuntimeError(f"could not submit task {i}")

    t0 = time.monotonic()
    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(n):
                tg.create_task(one(i))
    finally:
        for c in clients.values():
            await c.aclose()
    return {"seconds": round(time.monotonic() - t0, 2), "retries": errors}


async def until_placed(url: str, timeout: float = 300) -> Any:
    """The database's clock when no task of the backlog is queued any more, polled every 20 ms."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = await conn.fetchrow("""SELECT clock_timestamp() AS t, count(*) AS n FROM tasks
                                       WHERE state = 'queued' AND idempotency_key LIKE 'thr-%'""")
            if r["n"] == 0:
                return r["t"]
            await asyncio.sleep(0.02)
        raise RuntimeError("the backlog was not placed")
    finally:
        await conn.close()


def wait_ended(url: str, n: int, servers: list[Server], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if q(url, "SELECT count(*) FROM tasks WHERE state = ANY($1::text[])", TERMINAL)[0][0] >= n:
            return
        if not any(s.alive() for s in servers):
            raise RuntimeError("every replica died: " + " | ".join(s.output().splitlines()[-1] for s in servers))
        time.sleep(0.3)
    raise RuntimeError(f"not all {n} tasks ended within {timeout}s")


def run_one(replicas: int, tasks: int, latency_tasks: int, agents: int, slots: int, keep: bool) -> dict[str, Any]:
    db = f"podium_bench_{uuid.uuid4().hex[:10]}"
    asyncio.run(admin(f'CREATE DATABASE "{db}"'))
    url = with_db(PG_URL, db)
    tmp = Path(tempfile.mkdtemp(prefix=f"podium-replicas-{replicas}-"))
    env = {"PODIUM_TEST_FAST_TIMERS": "0"}  # production timers: the accept deadline is 15s, not 1.5s
    servers: list[Server] = []
    fleet: list[Agent] = []
    try:
        for _ in range(replicas):  # one at a time: the first one migrates the fresh database
            servers.append(Server(tmp, url, extra_env=env).start())
        for i in range(agents):
            k = i % replicas
            order = servers[k:] + servers[:k]
            fleet.append(Agent(tmp, [s.grpc for s in order], f"b{i:02d}", slots=slots, cpu=str(slots), memory=f"{slots}Gi",
                               extra_env=env).start())  # fmt: skip
        harness.wait_for(lambda: q(url, "SELECT count(*) FROM nodes WHERE connected")[0][0] == agents, 120, interval=0.3,
                         what="the agents to connect")  # fmt: skip
        load0 = os.getloadavg()
        # 1. latency: a steady stream of submissions onto a fleet with room
        t0 = time.monotonic()
        sub_lat = asyncio.run(submit([s.api for s in servers], latency_tasks, f"lat-{db}"))
        wait_ended(url, latency_tasks, servers)
        lat = [r["s"] for r in q(url, """
            SELECT extract(epoch FROM a.at - s.at)::float8 AS s FROM task_events s
            JOIN tasks t ON t.id = s.task_id AND t.idempotency_key LIKE 'lat-%'
            JOIN LATERAL (SELECT at FROM task_events e WHERE e.task_id = s.task_id AND e.to_state = 'assigned'
                          ORDER BY id LIMIT 1) a ON true
            WHERE s.to_state = 'queued'""")]  # fmt: skip
        lat_wall = time.monotonic() - t0

        # 2. placement throughput: a backlog queued behind drained nodes, then every node undrained at once
        with httpx.Client(timeout=30, headers=auth(servers[0].api)) as http:
            for a in fleet:
                http.post(f"{servers[0].api}/v1/nodes/{a.name}/drain").raise_for_status()
            commits0 = q(url, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0][0]
            sub = asyncio.run(submit([s.api for s in servers], tasks, f"thr-{db}"))
            t_undrain = q(url, "SELECT clock_timestamp() AS t")[0]["t"]
            for a in fleet:
                http.post(f"{servers[0].api}/v1/nodes/{a.name}/undrain").raise_for_status()
        t_placed = asyncio.run(until_placed(url))
        wait_ended(url, latency_tasks + tasks, servers)
        commits1 = q(url, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0][0]
        states = {r["state"]: r["count"] for r in q(url, "SELECT state, count(*) FROM tasks GROUP BY state")}
        span = q(url, """
            SELECT min(e.at) FILTER (WHERE to_state = 'assigned') AS a0, max(e.at) FILTER (WHERE to_state = 'assigned') AS a1,
                   max(e.at) FILTER (WHERE to_state = 'succeeded') AS s1,
                   count(*) FILTER (WHERE to_state = 'assigned') AS placements
            FROM task_events e JOIN tasks t ON t.id = e.task_id AND t.idempotency_key LIKE 'thr-%'""")[0]  # fmt: skip
        by = {r["actor"].removeprefix("scheduler:"): r["count"] for r in q(url, """
            SELECT actor, count(*) FROM task_events WHERE to_state = 'assigned' GROUP BY actor ORDER BY actor""")}
        batches = q(url, """
            SELECT count(*) AS n FROM task_events e JOIN tasks t ON t.id = e.task_id AND t.idempotency_key LIKE 'thr-%'
            WHERE e.to_state = 'assigned' GROUP BY e.actor, e.at""")  # one dispatch transaction = one now()
        revoked = q(url, "SELECT count(*) FROM attempts WHERE state = 'revoked'")[0][0]
        place_s = (span["a1"] - span["a0"]).total_seconds() if span["a1"] else float("nan")
        e2e_s = (span["s1"] - t_undrain).total_seconds() if span["s1"] else float("nan")
        drain_s = (t_placed - t_undrain).total_seconds()
        died = []
        for s in servers:
            if not s.alive():
                died.append({"log": s.log_path.name, "tail": s.output().splitlines()[-6:]})
        return {
            "replicas": replicas,
            "agents": agents,
            "slots_per_agent": slots,
            "states": states,
            "latency_phase": {
                "tasks": latency_tasks, "submit": sub_lat, "submit_per_s": round(latency_tasks / sub_lat["seconds"], 1),
                "wall_s": round(lat_wall, 2),
                "submit_to_assign_ms": {f"p{p}": round(pct(lat, p) * 1000, 1) for p in (50, 90, 99)}
                | {"max": round(max(lat) * 1000, 1) if lat else None, "n": len(lat)},
            },
            "throughput_phase": {
                "tasks": tasks, "submit": sub, "placements": span["placements"],
                "placements_per_s": round(tasks / drain_s, 1),
                "undrain_to_all_placed_s": round(drain_s, 3),
                "first_to_last_assigned_event_s": round(place_s, 3),
                "dispatch_batches": len(batches), "largest_batch": max((r["n"] for r in batches), default=0),
                "undrain_to_all_succeeded_s": round(e2e_s, 2),
                "commits_per_task": round((commits1 - commits0) / tasks, 2),
            },
            "placed_by": by,
            "revoked_attempts": revoked,
            "replicas_died": died,
            "loadavg": {"before": [round(x, 2) for x in load0], "after": [round(x, 2) for x in os.getloadavg()]},
            **({"tmp": str(tmp)} if keep else {}),
        }
    finally:
        for a in fleet:
            a.stop()
        for s in servers:
            s.stop()
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def pgbench() -> dict[str, Any]:
    """The database's commit rate on its own: pgbench's simple-update script without the branch
    updates (-N), 4 clients, 2 threads, 10 s, in a scratch database."""
    if not PGBENCH.exists():
        return {"skipped": f"{PGBENCH} is not installed"}
    m = re.match(r"postgresql://(?:(?P<user>[^@:/]+)(?::[^@]*)?@)?(?P<host>[^:/]+)(?::(?P<port>\d+))?/", PG_URL)
    assert m, PG_URL
    conn_args = ["-h", m["host"], "-p", m["port"] or "5432", "-U", m["user"] or "postgres"]
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{PGBENCH_DB}" WITH (FORCE)'))
    asyncio.run(admin(f'CREATE DATABASE "{PGBENCH_DB}"'))
    try:
        init = subprocess.run([str(PGBENCH), *conn_args, "-i", "-s", "1", "-q", PGBENCH_DB],
                              capture_output=True, text=True, timeout=300, check=False)
        if init.returncode != 0:
            return {"error": init.stderr[-500:]}
        r = subprocess.run([str(PGBENCH), *conn_args, *PGBENCH_ARGS, PGBENCH_DB], capture_output=True, text=True, timeout=120, check=False)
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", r.stdout)
        lat = re.search(r"latency average = ([\d.]+) ms", r.stdout)
        return {
            "args": PGBENCH_ARGS,
            "tps": float(tps.group(1)) if tps else None,
            "latency_avg_ms": float(lat.group(1)) if lat else None,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{PGBENCH_DB}" WITH (FORCE)'))


def table(runs: list[dict[str, Any]], pgb: dict[str, Any]) -> str:
    head = (f"{'replicas':>8} | {'submit/s':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7} | "
            f"{'placed':>6} {'place/s':>8} {'txns':>5} {'commits/task':>12} | placed by (per replica); died")
    lines = [head]
    for r in runs:
        lp, tp = r["latency_phase"], r["throughput_phase"]
        lat = lp["submit_to_assign_ms"]
        who = " ".join(str(v) for v in r["placed_by"].values())
        died = f"; DIED: {[d['log'] for d in r['replicas_died']]}" if r["replicas_died"] else ""
        lines.append(
            f"{r['replicas']:>8} | {lp['submit_per_s']:>8} {lat['p50']:>7} {lat['p90']:>7} {lat['p99']:>7} {lat['max']!s:>7} | "
            f"{tp['placements']:>6} {tp['placements_per_s']!s:>8} {tp['dispatch_batches']:>5} {tp['commits_per_task']:>12} | "
            f"[{who}]{died}"
        )
    if "tps" in pgb:
        lines.append(f"pgbench {' '.join(pgb['args'])} on the same PostgreSQL: {pgb['tps']:.0f} tps "
                     f"(= commits/s), average latency {pgb['latency_avg_ms']} ms")  # fmt: skip
    else:
        lines.append(f"pgbench: {pgb}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2,3")
    ap.add_argument("--tasks", type=int, default=2000, help="tasks in the placement-throughput backlog")
    ap.add_argument("--latency-tasks", type=int, default=1000, help="tasks in the latency stream")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--slots", type=int, default=256, help="slots per agent (agents x slots >= tasks)")
    ap.add_argument("--keep", action="store_true", help="keep the servers' and agents' logs")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "replicas.json")
    args = ap.parse_args()
    started = time.time()
    load_start = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for n in [int(x) for x in args.replicas.split(",")]:
        print(f"-- {n} replica(s): {args.agents} agents x {args.slots} slots; {args.latency_tasks} + {args.tasks} tasks", flush=True)
        runs.append(run_one(n, args.tasks, args.latency_tasks, args.agents, args.slots, args.keep))
        r = runs[-1]
        print(json.dumps({"states": r["states"], "latency_ms": r["latency_phase"]["submit_to_assign_ms"],
                          "placements_per_s": r["throughput_phase"]["placements_per_s"], "died": len(r["replicas_died"])}), flush=True)
    pgb = pgbench()
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    out = {
        "bench": "replicas",
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": load_start,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "code": {"commit": commit},
        "started_unix": started,
        "database": re.sub(r"//[^@]*@", "//", PG_URL),
        "runs": runs,
        "pgbench": pgb,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(table(runs, pgb))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
