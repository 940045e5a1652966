"""Requeue latency: how long after an agent dies its running task is requeued, against OfflineAfter.

    .venv/bin/python bench/requeue_latency.py --runs 20

What happens:

1. A fresh database `podium_bench_<random>` is created on the system PostgreSQL (`--pg-url`, default
   postgresql://postgres@127.0.0.1:5432/postgres) and one `python -m podium server` is started on it
   with PODIUM_TEST_FAST_TIMERS=1 (tests/harness.py's Server: heartbeat 1 s, unreachable 3 s, offline
   12 s, watchdog every 0.1 s). The database is dropped at the end, whatever happens.
2. Each run starts a fresh `podium agent` (one slot, a label of its own), submits `sleep 60` for that
   label with requeue on node loss allowed, waits for `running`, then SIGKILLs the agent and polls
   `GET /v1/tasks/{id}` every 20 ms until the task is no longer `running`. The task is then cancelled
   (it can never be placed again: its label died with the agent).
3. Per run: `elapsed` = first poll that saw the task leave `running` − the moment just before the
   SIGKILL (both CLOCK_MONOTONIC); `elapsed − OfflineAfter`; and from the database, the server's own
   view: the requeue event's time − the node's last recorded heartbeat (what the watchdog compares
   with OfflineAfter, so always ≥ it; the excess is the watchdog's detection lag) and the requeue
   event's time − the SIGKILL (wall clocks of the same machine).

elapsed is below OfflineAfter by however long before the kill the last heartbeat was (0 to one
heartbeat interval), plus the watchdog's lag (≤ one watchdog interval plus a sweep), plus the
poll's granularity (20 ms plus one request). The recorded heartbeat time is when the gateway's
batched flush wrote it (every heartbeat/4, 0.25 s here), so it can be a little after the kill, and
elapsed a little above OfflineAfter.

Results: a table on stdout and bench/results/requeue_latency.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podium.timing import timing_from_env  # noqa: E402
from tests.harness import Agent, Api, Server, wait_for  # noqa: E402

T = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1"})  # what the harness's processes run with
POLL = 0.020
RESULTS = ROOT / "bench" / "results"


def with_db(url: str, db: str) -> str:
    base, _, rest = url.partition("?")
    head, _, _old = base.rpartition("/")
    return f"{head}/{db}" + (f"?{rest}" if rest else "")


async def admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def server_view(db_url: str, task_id: str, node_id: str) -> dict[str, Any]:
    """The requeue as the database recorded it: the event, the node's last heartbeat."""
    conn = await asyncpg.connect(db_url, timeout=10)
    try:
        ev = await conn.fetchrow(
            "SELECT at, to_state, reason, actor FROM task_events WHERE task_id = $1 AND from_state = 'running' ORDER BY id LIMIT 1",
            uuid.UUID(task_id),
        )
        node = await conn.fetchrow("SELECT last_heartbeat_at, health FROM nodes WHERE id = $1", node_id)
    finally:
        await conn.close()
    assert ev is not None and node is not None
    return {
        "event_at": ev["at"].timestamp(),
        "to_state": ev["to_state"],
        "reason": ev["reason"],
        "actor": ev["actor"],
        "last_heartbeat_at": node["last_heartbeat_at"].timestamp(),
        "node_health": node["health"],
    }


async def diagnose(db_url: str, task_id: str) -> dict[str, Any]:
    conn = await asyncpg.connect(db_url, timeout=10)
    try:
        task = await conn.fetchrow("SELECT * FROM tasks WHERE id = $1", uuid.UUID(task_id))
        events = await conn.fetch("SELECT * FROM task_events WHERE task_id = $1 ORDER BY id", uuid.UUID(task_id))
        attempts = await conn.fetch("SELECT * FROM attempts WHERE task_id = $1 ORDER BY attempt", uuid.UUID(task_id))
        nodes = await conn.fetch("SELECT * FROM nodes ORDER BY created_at")
    finally:
        await conn.close()
    return {"task": dict(task) if task else None, "events": [dict(e) for e in events],
            "attempts": [dict(a) for a in attempts], "nodes": [dict(n) for n in nodes]}


def one_run(i: int, tmp: Path, srv: Server, api: Api, db_url: str) -> dict[str, Any]:
    label = f"r{i:03d}"
    agent = Agent(tmp, [srv.grpc], f"bench-{label}", labels={"bench": label}, slots=1)
    agent.start()
    try:
        node_id = agent.node_id()
        tid = api.submit(command=["sleep", "60"], labels={"bench": label}, requeue_on_node_loss=True, max_attempts=3)["id"]
        try:
            api.wait_state(tid, "running", 60)
        except AssertionError:
            found = json.dumps(asyncio.run(diagnose(db_url, tid)), indent=1, default=str)
            print(f"run {i}: task {tid} never started on {node_id}:\n{found}")
            raise
        # the task is running; let a heartbeat or two go by so the kill lands at a random phase of it
        time.sleep(1.0 + random.uniform(0, T.heartbeat))
        assert api.task(tid)["state"] == "running"

        kill_wall = time.time()
        t0 = time.monotonic()
        os.kill(agent.pid, signal.SIGKILL)
        polls = 0
        deadline = t0 + T.offline_after * 3
        next_at = t0
        while True:
            state = api.task(tid)["state"]
            polls += 1
            now = time.monotonic()
            if state != "running":
                elapsed = now - t0
                break
            if now > deadline:
                raise AssertionError(f"run {i}: task {tid} still running {now - t0:.1f}s after the SIGKILL")
            next_at += POLL
            time.sleep(max(0.0, next_at - time.monotonic()))
        agent.p.wait(10)  # type: ignore[union-attr]  # reap it
        view = asyncio.run(server_view(db_url, tid, node_id))
        api.http.post(f"/v1/tasks/{tid}/cancel")  # its label died with the agent: it can never run again
        return {
            "run": i,
            "task": tid,
            "node": node_id,
            "state_seen": state,
            "elapsed_s": elapsed,
            "minus_offline_after_s": elapsed - T.offline_after,
            "server_event_after_kill_s": view["event_at"] - kill_wall,
            "event_after_last_heartbeat_s": view["event_at"] - view["last_heartbeat_at"],
            "last_heartbeat_before_kill_s": kill_wall - view["last_heartbeat_at"],
            "polls": polls,
            **{k: view[k] for k in ("to_state", "reason", "actor", "node_health")},
        }
    finally:
        agent.stop()


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "mean": statistics.fmean(values)}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    with contextlib.suppress(OSError):
        info["loadavg"] = list(os.getloadavg())
    try:
        info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10).stdout.split("\n")  # fmt: skip
        info["src_changes"] = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--pg-url", default=os.environ.get("PODIUM_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
                    help="an admin connection to the PostgreSQL server to create the database on")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS / "requeue_latency.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory with the server and agent logs")
    args = ap.parse_args()

    db = f"podium_bench_{uuid.uuid4().hex[:10]}"
    db_url = with_db(args.pg_url, db)
    tmp = Path(tempfile.mkdtemp(prefix="podium-requeue-"))
    asyncio.run(admin(args.pg_url, f'CREATE DATABASE "{db}"'))
    srv: Server | None = None
    api: Api | None = None
    runs: list[dict[str, Any]] = []
    ok = False
    try:
        srv = Server(tmp, db_url)
        srv.start()
        api = Api(srv.api)
        wait_for(lambda: api.http.get("/v1/nodes").status_code == 200, 30, what="the API to answer with the admin token")
        print(f"server {srv.api} on database {db}; OfflineAfter {T.offline_after:g}s, heartbeat {T.heartbeat:g}s, "
              f"watchdog {T.watchdog:g}s, poll {POLL * 1000:.0f}ms")  # fmt: skip
        for i in range(args.runs):
            r = one_run(i, tmp, srv, api, db_url)
            runs.append(r)
            print(f"  run {i + 1:2d}/{args.runs}: elapsed {r['elapsed_s']:6.3f}s  −OfflineAfter {r['minus_offline_after_s']:+6.3f}s"
                  f"  (last heartbeat {r['last_heartbeat_before_kill_s']:.3f}s before the kill; requeued "
                  f"{r['event_after_last_heartbeat_s']:.3f}s after it) → {r['to_state']}", flush=True)  # fmt: skip
        ok = True
    finally:
        if api is not None:
            api.close()
        if srv is not None:
            srv.stop()
        asyncio.run(admin(args.pg_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        if args.keep or not ok:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    stats = {
        "elapsed_s": summary([r["elapsed_s"] for r in runs]),
        "minus_offline_after_s": summary([r["minus_offline_after_s"] for r in runs]),
        "server_event_after_kill_s": summary([r["server_event_after_kill_s"] for r in runs]),
        "event_after_last_heartbeat_s": summary([r["event_after_last_heartbeat_s"] for r in runs]),
        "watchdog_lag_s": summary([r["event_after_last_heartbeat_s"] - T.offline_after for r in runs]),
    }
    result = {
        "scenario": "requeue_latency",
        "config": {"runs": args.runs, "poll_s": POLL, "fast_timers": True, "offline_after_s": T.offline_after,
                   "unreachable_after_s": T.unreachable_after, "heartbeat_s": T.heartbeat, "watchdog_s": T.watchdog,
                   "postgresql": args.pg_url.rpartition("@")[2].partition("/")[0]},  # fmt: skip
        "machine": machine(),
        "summary": stats,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print()
    print(f"{'seconds':<44}{'min':>9}{'median':>9}{'max':>9}")
    rows = [
        ("SIGKILL → seen requeued (elapsed)", "elapsed_s"),
        ("elapsed − OfflineAfter", "minus_offline_after_s"),
        ("SIGKILL → requeue event (database)", "server_event_after_kill_s"),
        ("last heartbeat → requeue event", "event_after_last_heartbeat_s"),
        ("  of which past OfflineAfter (watchdog lag)", "watchdog_lag_s"),
    ]
    for title, key in rows:
        s = stats[key]
        print(f"{title:<44}{s['min']:>9.3f}{s['median']:>9.3f}{s['max']:>9.3f}")
    print(f"OfflineAfter {T.offline_after:g}s, heartbeat {T.heartbeat:g}s, watchdog interval {T.watchdog:g}s; "
          f"{len(runs)} runs; written to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
