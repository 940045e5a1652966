"""The fleet a nemesis campaign runs on: N agent hosts, each in its own network namespace, and two
server replicas on one PostgreSQL, all with mutual TLS and node certificates.

    workload ──https──▶ replica r0 / r1 (root namespace; API on loopback, gateway on the bridge)
                              │ each through its own proxy (cut = partition from PostgreSQL)
                              ▼
                        PostgreSQL: the harness's own embedded one (restartable), or
                        the system's 15 on 127.0.0.1:5432 (--pg system); a fresh database per run
    host h<i> (netns) ── veth ── bridge ── proxy h<i>→r<j> ── replica r<j> gateway

Replicas and agents are started from the ExecStart lines of deploy/systemd/*.service (the same
command lines an operator installs), with the unit's paths mapped into the run's directory.
A run's database, namespaces and links carry its pid; a crashed run's leftovers are removed by the
next one. It must never reach anything but loopback and the namespaces it made.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import shlex
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from podium.agent.fence import start_time
from tests.nemesis import disk
from tests.nemesis.disk import SlowDisk
from tests.nemesis.net import HostNet, Net, _alive
from tests.nemesis.pg import OwnPostgres
from tests.nemesis.pki import FleetPki
from tests.nemesis.proxy import Link, ProxyHub

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
PG_ADMIN = os.environ.get("PODIUM_TEST_PG15_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DB_PREFIX = "podium_nemesis_"


def unit_command(unit: str, env: dict[str, str], paths: dict[str, str], hostname: str = "") -> list[str]:
    """The ExecStart of a unit in deploy/systemd as argv: `${X}` and `$X` from `env` (as systemd
    expands them: `${X}` one word, `$X` split on whitespace), `%H` the host name, the unit's paths
    mapped by `paths`, and `/usr/local/bin/podium` this interpreter running the package."""
    text = (UNITS / unit).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))[len("ExecStart="):]
    argv: list[str] = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$[A-Z_]+", word):
            argv += env.get(word[1:], "").split()
            continue
        word = re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word).replace("%H", hostname)
        argv.append(paths.get(word, word))
    if argv[0] == "/usr/local/bin/podium":
        argv = [sys.executable, "-m", "podium", *argv[1:]]
    return argv


def _with_db(url: str, db: str) -> str:
    base, _, rest = url.partition("?")
    return base.rpartition("/")[0] + f"/{db}" + (f"?{rest}" if rest else "")


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PODIUM_TEST_FAST_TIMERS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    for k in ("PODIUM_DATABASE_URL", "PODIUM_JOIN_TOKEN", "LD_PRELOAD", "FAKETIME"):
        env.pop(k, None)
    return env


def faketime_lib() -> str | None:
    libs = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1")) + sorted(Path("/usr/lib").glob("faketime/libfaketimeMT.so.1"))
    return str(libs[0]) if libs else None


PIDS_PREFIX = "podium-nemesis-pids-"


def _pids_file() -> Path:
    """Every process the harness starts is listed here, so a run after a crash can stop them."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"{PIDS_PREFIX}{os.getpid()}"


def cleanup_stale_processes(log: Any = print) -> None:
    import tempfile

    for f in Path(tempfile.gettempdir()).glob(PIDS_PREFIX + "*"):
        owner = f.name[len(PIDS_PREFIX):]
        if not owner.isdigit() or _alive(int(owner)):
            continue
        for line in f.read_text().splitlines():
            try:
                pid, _, started = line.partition(" ")
                # the pid may have been reused since (another run's agent, say): only the very process
                if started and start_time(int(pid)) != int(started):
                    continue
                with open(f"/proc/{int(pid)}/cmdline", "rb") as c:
                    if b"podium" not in c.read():
                        continue  # the pid was reused by something else
                os.kill(int(pid), signal.SIGKILL)
                log(f"fleet: killed {pid}, left running by run {owner}")
            except (OSError, ValueError):
                pass
        f.unlink(missing_ok=True)


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    p: subprocess.Popen[bytes] | None = None
    stopped: bool = False  # SIGSTOPped by the nemesis

    def start(self) -> None:
        with open(self.log, "ab") as f:
            f.write(f"\n==== start {time.time():.3f}: {shlex.join(self.argv)}\n".encode())
            self.p = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with open(_pids_file(), "a") as pf:
            pf.write(f"{self.p.pid} {start_time(self.p.pid) or ''}\n")
        self.stopped = False

    @property
    def pid(self) -> int:
        assert self.p is not None
        return self.p.pid

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
            self.stopped = sig == signal.SIGSTOP

    def kill(self) -> None:
        if self.alive():
            assert self.p is not None
            self.p.kill()
            self.p.wait(10)

    def stop(self, timeout: float = 20) -> None:
        if not self.alive():
            return
        assert self.p is not None
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@dataclass
class Replica:
    name: str
    api_port: int
    grpc_port: int
    data_dir: Path
    db_link: Link
    proc: Proc
    skew: str | None = None

    @property
    def api(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"


@dataclass
class Host:
    name: str
    net: HostNet
    state_dir: Path
    proc: Proc
    links: list[Link] = field(default_factory=list)  # one per replica

    def node_id(self) -> str | None:
        p = self.state_dir / "node-id"
        return p.read_text().strip() if p.exists() else None


class Fleet:
    def __init__(self, root: Path, hosts: int = 3, replicas: int = 2, slots: int = 2, seed: int = 0,
                 pg: str = "embedded", log: Any = print) -> None:  # fmt: skip
        self.root = root
        self.n_hosts, self.n_replicas, self.slots = hosts, replicas, slots
        self.log = log
        self.db = f"{DB_PREFIX}{os.getpid()}"
        self.pg_kind = pg
        self.own_pg: OwnPostgres | None = None
        self.slow_disk: SlowDisk | None = None  # under own_pg, where the kernel can throttle it
        self.admin_url = PG_ADMIN
        self.db_url = _with_db(PG_ADMIN, self.db)
        self.truth = root / "truth"  # written by the tasks themselves; no server is told of it
        self.net: Net | None = None
        self.hub = ProxyHub(seed)
        self.replicas: list[Replica] = []
        self.hosts: list[Host] = []
        self.admin_token = ""
        self.join_token = ""

    # ---- database ------------------------------------------------------------------------------

    async def _admin(self, sql: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.admin_url, timeout=10)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    async def _create_db(self) -> None:
        for r in await self._admin("SELECT datname FROM pg_database WHERE datname LIKE $1", DB_PREFIX + "%"):
            pid = r["datname"][len(DB_PREFIX):]
            if pid.isdigit() and not _alive(int(pid)):
                await self._admin(f'DROP DATABASE IF EXISTS "{r["datname"]}" WITH (FORCE)')
                self.log(f"fleet: dropped {r['datname']}, left by an earlier run")
        await self._admin(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
        await self._admin(f'CREATE DATABASE "{self.db}"')

    async def connect_db(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.db_url, timeout=10)

    async def terminate_connections(self) -> int:
        rows = await self._admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", self.db)
        return len(rows)

    async def db_connections(self) -> int:
        rows = await self._admin("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = $1", self.db)
        return int(rows[0]["n"])

    # ---- processes -----------------------------------------------------------------------------

    def _replica_proc(self, r: Replica, skew: str | None) -> Proc:
        env = _base_env()
        env.update({
            "PODIUM_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{r.db_link.port}/{self.db}",
            "PODIUM_SECRET_KEY_FILE": str(self.root / "secret.key"),
            "PODIUM_API_HOST": "127.0.0.1", "PODIUM_API_PORT": str(r.api_port),
            "PODIUM_GRPC_HOST": self.net.gateway if self.net else "127.0.0.1", "PODIUM_GRPC_PORT": str(r.grpc_port),
        })  # fmt: skip
        lib = faketime_lib()
        if skew and lib:
            env.update({"LD_PRELOAD": lib, "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
        tls = self.root / "pki"
        argv = unit_command("podium-server.service", env, {
            "/var/lib/podium": str(r.data_dir), "/etc/podium/tls/server.pem": str(tls / "server.pem"),
            "/etc/podium/tls/server.key": str(tls / "server.key"), "/etc/podium/tls/ca.pem": str(tls / "ca.pem"),
        })  # fmt: skip
        return Proc(r.name, argv, env, self.root / f"{r.name}.log")

    def _agent_proc(self, h: Host) -> Proc:
        assert self.net is not None
        env = _base_env()
        env.update({
            "PODIUM_JOIN_TOKEN": self.join_token,
            "PODIUM_AGENT_ARGS": f"--slots {self.slots} --cpu 2 --memory 2Gi --journal {self.root / (h.name + '.journal')}",
        })  # fmt: skip
        for j, link in enumerate(h.links):
            env[f"PODIUM_SERVER_{'AB'[j]}"] = f"{self.net.gateway}:{link.port}"
        tls = self.root / "pki"
        argv = unit_command("podium-agent.service", env, {
            "/var/lib/podium-agent": str(h.state_dir), "/etc/podium/tls/ca.pem": str(tls / "ca.pem"),
            "/etc/podium/tls/agent.pem": str(tls / f"{h.name}.pem"), "/etc/podium/tls/agent.key": str(tls / f"{h.name}.key"),
        }, hostname=h.name)  # fmt: skip
        return Proc(h.name, ["ip", "netns", "exec", h.net.ns, *argv], env, self.root / f"{h.name}.log")

    def _free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def wait_ready(self, r: Replica, timeout: float = 90) -> None:
        ctx = ssl.create_default_context(cafile=str(self.root / "pki" / "ca.pem"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not r.proc.alive():
                raise RuntimeError(f"{r.name} exited:\n{r.proc.tail()}")
            try:
                with httpx.Client(timeout=2, verify=ctx) as c:
                    if c.get(f"{r.api}/healthz").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{r.name} did not answer /healthz in {timeout}s:\n{r.proc.tail()}")

    def start_replica(self, r: Replica, skew: str | None = None, wait: bool = True) -> None:
        r.skew = skew
        r.proc = self._replica_proc(r, skew)
        r.proc.start()
        if wait:
            self.wait_ready(r)

    def start(self) -> Fleet:
        import asyncio

        self.root.mkdir(parents=True, exist_ok=True)
        self.truth.mkdir(exist_ok=True)
        cleanup_stale_processes(self.log)
        target: tuple[str, int] | str = ("127.0.0.1", 5432)
        if self.pg_kind == "embedded":
            self.own_pg = OwnPostgres(self.log).start()
            self.admin_url = self.own_pg.admin_url
            self.db_url = _with_db(self.admin_url, self.db)
            target = self.own_pg.socket
            # two replicas hold up to ~70 connections, and killed replicas leave theirs for a while
            asyncio.run(self._admin("ALTER SYSTEM SET max_connections = 300"))
            self.own_pg.restart()
            disk.cleanup_stale(self.log)
            assert self.own_pg.emb is not None and self.own_pg.emb._server is not None
            pgdata = Path(self.own_pg.emb._server.pgdata)
            why = disk.unavailable(pgdata)
            if why is None:
                self.slow_disk = SlowDisk(pgdata, self.log)
            else:
                self.log(f"fleet: no disk-slow faults: {why}")
        asyncio.run(self._create_db())
        self.net = Net(self.log).up()
        pki = FleetPki(self.root / "pki")
        pki.server("server", ["127.0.0.1", self.net.gateway])  # server.pem/.key, as the unit names them
        (self.root / "secret.key").write_bytes(base64.b64encode(secrets.token_bytes(32)) + b"\n")
        (self.root / "secret.key").chmod(0o600)
        for i in range(self.n_replicas):
            name = f"r{i}"
            link = self.hub.add(f"{name}-db", "127.0.0.1", target)
            r = Replica(name, self._free_port(), self._free_port(), self.root / name, link, Proc(name, [], {}, self.root / f"{name}.log"))
            self.replicas.append(r)
            # one after the other: the first migrates the fresh database and makes the tokens
            self.start_replica(r)
            if i == 0:
                self.admin_token = (r.data_dir / "admin-token").read_text().strip()
                self.join_token = (r.data_dir / "join-token").read_text().strip()
        for i in range(self.n_hosts):
            hn = self.net.add_host()
            name = f"h{i}"
            pki.node(name)
            h = Host(name, hn, self.root / f"{name}-state", Proc(name, [], {}, self.root / f"{name}.log"))
            for r in self.replicas:
                h.links.append(self.hub.add(f"{name}->{r.name}", self.net.gateway, (self.net.gateway, r.grpc_port)))
            h.proc = self._agent_proc(h)
            h.proc.start()
            self.hosts.append(h)
        return self

    def online_nodes(self) -> int:
        try:
            return sum(1 for n in self.api_get("/v1/nodes") if n["health"] == "online" and n["connected"])
        except Exception:
            return 0

    def api_get(self, path: str) -> Any:
        ctx = ssl.create_default_context(cafile=str(self.root / "pki" / "ca.pem"))
        last: Exception | None = None
        for r in self.replicas:
            try:
                with httpx.Client(timeout=10, verify=ctx, headers={"Authorization": f"Bearer {self.admin_token}"}) as c:
                    resp = c.get(f"{r.api}{path}")
                    if resp.status_code == 200:
                        return resp.json()
                    last = RuntimeError(f"{path}: {resp.status_code} {resp.text[:200]}")
            except httpx.HTTPError as e:
                last = e
        raise RuntimeError(f"no replica answered {path}: {last}")

    def stop(self) -> None:
        for h in self.hosts:
            h.proc.stop()
        for r in self.replicas:
            r.proc.stop()
        self.hub.close()
        if self.net is not None:
            self.net.down()
        import asyncio

        _pids_file().unlink(missing_ok=True)
        if self.slow_disk is not None:
            self.slow_disk.remove()
        if self.own_pg is not None:
            self.own_pg.stop()
            return
        try:
            asyncio.run(self._admin(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)'))
        except (OSError, asyncpg.PostgresError) as e:
            self.log(f"fleet: could not drop {self.db}: {e}")
