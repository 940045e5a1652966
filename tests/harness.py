"""Real processes for acceptance tests: a `podium server`, `podium agent`s and the `podium` CLI, each
started as its own process exactly as an operator would start it, with fast timers."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

# The tokens a server bootstrapped, by where to reach it: a test acts as its admin, and its agents
# join with its join token. Replicas sharing one database share the tokens the first one made.
ADMIN_TOKENS: dict[str, str] = {}  # API base URL → admin token
JOIN_TOKENS: dict[str, str] = {}  # gateway address → join token
_BY_DATABASE: dict[str, tuple[str, str]] = {}
CA_FILES: dict[str, Path] = {}  # API base URL → the CA that signed its certificate


PORTS_PER_WORKER = 1000
_handed = itertools.count()


def _port_range() -> range:
    """The ports this test process hands out: outside the kernel's ephemeral range, a slice for each
    xdist worker. A port the kernel picks (bind to 0) is one of that range, which every outgoing
    connection takes its own from: between the pick and the server's bind, one of the suite's many
    client connections could take it (a server that then died of "address already in use")."""
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    below = 10000 + n * PORTS_PER_WORKER
    if below + PORTS_PER_WORKER <= low:
        return range(below, below + PORTS_PER_WORKER)
    above = high + 1 + n * PORTS_PER_WORKER
    if above + PORTS_PER_WORKER <= 65536:
        return range(above, above + PORTS_PER_WORKER)
    return range(0)  # no room outside it: the kernel's pick


def free_port() -> int:
    """A port no one listens on now, from this worker's own range (see `_port_range`)."""
    ports = _port_range()
    for _ in range(len(ports)):
        port = ports[next(_handed) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or still held by a connection that closed: the next one
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], T], timeout: float = 60.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `cond` until it returns something truthy. Generous timeouts: these machines are noisy."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # the server may be restarting
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PODIUM_TEST_FAST_TIMERS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.env = env
        self.log_path = log
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.p is not None
        return self.p.pid

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def signal(self, sig: int) -> None:
        assert self.p is not None
        os.kill(self.p.pid, sig)

    def stop(self, timeout: float = 20) -> None:
        if self.p is None:
            return
        if self.p.poll() is None:
            # SIGCONT first: a test may have left it stopped
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.p.pid, sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._log.close()

    def kill(self) -> None:
        assert self.p is not None
        self.p.kill()
        self.p.wait(10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Server(Proc):
    def __init__(self, tmp: Path, db_url: str | None, *, port: int | None = None, grpc_port: int | None = None,
                 data_dir: Path | None = None, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, scheme: str = "http", ca_file: Path | None = None) -> None:  # fmt: skip
        self.scheme = scheme
        self.ca_file = ca_file
        self.port = port or free_port()
        self.grpc_port = grpc_port or free_port()
        env = base_env(**(extra_env or {}))
        # Several servers of one test share the PostgreSQL 15 the suite uses (max_connections 100):
        # each opens at most this many connections, so three replicas and the test itself fit.
        env.setdefault("PODIUM_DB_CONNECTIONS", "24")
        if db_url:
            env["PODIUM_DATABASE_URL"] = db_url
        else:
            env.pop("PODIUM_DATABASE_URL", None)
        self.data_dir = data_dir or tmp / "data"
        self.db_key = db_url or f"embedded:{self.data_dir}"
        args = [sys.executable, "-m", "podium", "server", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                "--data-dir", str(self.data_dir), *(extra_args or [])]  # fmt: skip
        super().__init__(args, env, tmp / f"server-{self.port}.log")

    @property
    def api(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, wait: bool = True) -> Server:
        super().start()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"server exited:\n{self.output()[-3000:]}")
            verify = ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else True
            with httpx.Client(timeout=2, verify=verify) as c:
                return c.get(f"{self.api}/healthz").status_code == 200

        try:
            wait_for(ready, timeout, what="the server to answer /healthz")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- server log ---\n{self.output()[-3000:]}") from None
        admin, join = self.data_dir / "admin-token", self.data_dir / "join-token"
        if admin.exists() and join.exists():
            _BY_DATABASE[self.db_key] = (admin.read_text().strip(), join.read_text().strip())
        if self.ca_file:
            CA_FILES[self.api] = self.ca_file
        tokens = _BY_DATABASE.get(self.db_key)
        if tokens:
            ADMIN_TOKENS[self.api] = tokens[0]
            JOIN_TOKENS[self.grpc] = tokens[1]

    @property
    def admin_token(self) -> str:
        return ADMIN_TOKENS[self.api]


class Agent(Proc):
    def __init__(self, tmp: Path, servers: list[str], name: str, *, labels: dict[str, str] | None = None,
                 slots: int = 4, cpu: str = "4", memory: str = "8Gi", extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.state_dir = tmp / f"agent-{name}"
        self.journal = tmp / f"journal-{name}.jsonl"
        args = [sys.executable, "-m", "podium", "agent", "--name", name, "--state-dir", str(self.state_dir),
                "--slots", str(slots), "--cpu", cpu, "--memory", memory, "--journal", str(self.journal)]  # fmt: skip
        for s in servers:
            args += ["--server", s]
        for k, v in (labels or {}).items():
            args += ["--label", f"{k}={v}"]
        args += extra_args or []
        env = base_env(**(extra_env or {}))
        join = next((JOIN_TOKENS[s] for s in servers if s in JOIN_TOKENS), None)
        if join and "PODIUM_JOIN_TOKEN" not in (extra_env or {}):
            env["PODIUM_JOIN_TOKEN"] = join
        super().__init__(args, env, tmp / f"agent-{name}.log")

    def node_id(self) -> str:
        return wait_for(lambda: (self.state_dir / "node-id").exists() and (self.state_dir / "node-id").read_text().strip(),
                        30, what=f"agent {self.name} to write its node id")  # fmt: skip

    def journal_entries(self) -> list[dict[str, Any]]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]


def held_until(release: Path) -> str:
    """A shell loop that runs until `release` exists (two minutes at most): a task that holds what it
    has until the test lets it go, instead of a sleep of a fixed length a slow machine can outlast."""
    return f"for i in $(seq 1200); do [ -e '{release}' ] && break; sleep 0.1; done"


class Api:
    def __init__(self, base: str, token: str | None = None, ca_file: Path | None = None) -> None:
        self.base = base
        token = token or ADMIN_TOKENS.get(base)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ca = ca_file or CA_FILES.get(base)
        verify = ssl.create_default_context(cafile=str(ca)) if ca else True
        self.http = httpx.Client(base_url=base, timeout=30, headers=headers, verify=verify)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def submit(self, **spec: Any) -> dict[str, Any]:
        r = self._post_until_taken("/v1/tasks", spec)
        return r.json()["task"]

    def submit_batch(self, *specs: dict[str, Any]) -> list[str]:
        """Several tasks in one request (one transaction): the ids, in order. For a test whose node
        must answer every Assign within the accept deadline, which a submission after another (a
        429 waited out between them) can outlast."""
        r = self._post_until_taken("/v1/tasks/batch", {"tasks": list(specs)})
        return [t["task"]["id"] for t in r.json()]

    def _post_until_taken(self, path: str, body: dict[str, Any]) -> httpx.Response:
        # a server that sheds load (429) on a noisy machine is answered as a real client would
        deadline = time.monotonic() + 60
        while True:
            r = self.http.post(path, json=body)
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(float(r.headers.get("Retry-After", "1")))
        assert r.status_code in (200, 201), r.text
        return r

    def task(self, tid: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/tasks/{tid}")
        assert r.status_code == 200, r.text
        return r.json()

    def nodes(self) -> list[dict[str, Any]]:
        return self.http.get("/v1/nodes").json()

    def wait_state(self, tid: str, states: str | tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
        want = (states,) if isinstance(states, str) else states
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            last.update(self.task(tid))
            return dict(last) if last["state"] in want else None

        try:
            return wait_for(check, timeout, what=f"task {tid} to be {want}")
        except AssertionError as e:
            # what the task said last is the first thing anyone reading the failure needs
            raise AssertionError(f"{e}; it was {last.get('state')!r}: {last.get('reason')!r}") from None

    def wait_node(self, name: str, timeout: float = 60, **want: Any) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            for n in self.nodes():
                if n["name"] == name and all(n.get(k) == v for k, v in want.items()):
                    return n
            return None

        return wait_for(check, timeout, what=f"node {name} with {want}")


def cli(addr: str, *args: str, timeout: float = 120, input: str | None = None, token: str | None = None,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    env = base_env(PODIUM_ADDR=addr, **(extra_env or {}))
    tok = token if token is not None else ADMIN_TOKENS.get(addr)
    if tok:
        env["PODIUM_TOKEN"] = tok
    else:
        env.pop("PODIUM_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "podium", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, input=input)  # fmt: skip


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def attempt_intervals(agents: list[Agent]) -> dict[str, list[tuple[float, float, int, str]]]:
    """Ground truth from the agents' journals: per task, (start, end, token, node) of every process
    that actually ran. The end is the first stop or fence recorded for that token; an attempt with
    neither is taken as still running."""
    starts: dict[int, tuple[str, float, str]] = {}
    ends: dict[int, float] = {}
    for a in agents:
        for e in a.journal_entries():
            if e["ev"] == "start":
                starts[e["token"]] = (e["task"], e["t"], a.name)
            elif e["ev"] in ("stop", "fence"):
                ends[e["token"]] = min(ends.get(e["token"], float("inf")), e["t"])
    out: dict[str, list[tuple[float, float, int, str]]] = {}
    for token, (task, t0, node) in starts.items():
        out.setdefault(task, []).append((t0, ends.get(token, float("inf")), token, node))
    return {k: sorted(v) for k, v in out.items()}


def assert_at_most_one_attempt_at_once(agents: list[Agent]) -> None:
    for task, spans in attempt_intervals(agents).items():
        for (_s1, e1, tok1, n1), (s2, _e2, tok2, n2) in zip(spans, spans[1:], strict=False):
            assert e1 <= s2, (
                f"task {task}: attempt {tok1} on {n1} was still running ({e1 - s2:.3f}s) when attempt {tok2} started on {n2}"
            )
