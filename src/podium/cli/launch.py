"""The commands that start things: `podium server`, `podium agent`, `podium dev` (embedded
PostgreSQL, a server and one local agent) and `podium db migrate`. They run in this process (or
its children); they must never be HTTP clients of a server, save `dev --demo`'s first task.
Each imports what it starts (the server stack, the agent, asyncio) inside itself: listing these
commands, or running an operator command, must not load them."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from podium.cli.base import (
    EXIT_BUSY,
    EXIT_REFUSED,
    EXIT_SUPERSEDED,
    CliError,
    app,
    db_app,
    default_data_dir,
    err,
    labels,
    out,
    parse,
    setup_logging,
)  # fmt: skip
from podium.units import parse_cpu, parse_duration, parse_size


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
        envvar="PODIUM_DB_CONNECTIONS", min=18, max=10_000,  # podium.server.MIN_DB_CONNECTIONS
        help="the most PostgreSQL connections this server opens (its pools and listeners): keep replicas × this "
             "below the server's max_connections")] = 40,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a server. With PODIUM_DATABASE_URL it uses that PostgreSQL; without, an embedded one."""
    from podium.eventloop import run_loop
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
    setup_logging(verbose)
    cfg = ServerConfig(
        data_dir=data_dir or default_data_dir(),
        database_url=os.environ.get("PODIUM_DATABASE_URL") or None,
        host=host, port=port, grpc_host=grpc_host, grpc_port=grpc_port, placement_policy=placement,
        tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca, retention=parse(parse_duration, retention, "--retention"),
        max_lag=parse(parse_duration, max_lag, "--max-lag"), serialization_retry_limit=serialization_retry_limit,
        db_connections=db_connections,
    )  # fmt: skip

    async def main() -> None:
        srv = PodiumServer(cfg)
        install_signal_handlers(srv)
        await srv.run()

    run_loop(main())


@app.command()
def agent(
    server_addr: Annotated[list[str], typer.Option("--server", "-s", help="gateway address host:port; repeat for failover")],
    name: Annotated[str | None, typer.Option(help="node name (default: the host name)")] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="a node label key=value; repeatable")] = [],  # noqa: B006
    cpu: Annotated[str | None, typer.Option(help="CPU to offer: cores (2, 0.5) or millicores (500m); default all")] = None,
    memory: Annotated[str | None, typer.Option(help="memory to offer (4Gi, 512Mi); default all")] = None,
    slots: Annotated[int, typer.Option(help="how many tasks may run at once", min=1, max=10000)] = 8,
    max_operations: Annotated[
        int | None,
        typer.Option(help="how many tasks may be prepared (pulled, created) at once; default: as many as --slots", min=1, max=1024),
    ] = None,
    pool: Annotated[str, typer.Option(help="the node's pool")] = "default",
    capability: Annotated[list[str], typer.Option("--capability", help="a capability this node offers; repeatable")] = [],  # noqa: B006
    artifact: Annotated[list[str], typer.Option("--artifact", help="an artifact (image digest) present here; repeatable")] = [],  # noqa: B006
    state_dir: Annotated[Path | None, typer.Option(help="where the node keeps its id and task work dirs")] = None,
    journal: Annotated[Path | None, typer.Option(help="append what actually started/stopped here (JSON lines)")] = None,
    tls: Annotated[bool, typer.Option("--tls", help="connect with TLS, verifying the server with the system's CAs")] = False,
    ca_file: Annotated[Path | None, typer.Option(help="verify the server with this CA (PEM); implies TLS")] = None,
    cert: Annotated[Path | None, typer.Option(help="client certificate (PEM) for mutual TLS")] = None,
    key: Annotated[Path | None, typer.Option(help="client key (PEM) for mutual TLS")] = None,
    backend: Annotated[list[str], typer.Option(
        "--backend", help="what this node runs: process, container; repeatable (default: process)")] = [],  # noqa: B006
    container_host: Annotated[str | None, typer.Option(
        help="the container engine's API (unix:///run/podman/podman.sock, tcp://…); default DOCKER_HOST, "
             "else the engine's default socket")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run an agent: join a server (PODIUM_JOIN_TOKEN the first time) and run what it assigns."""
    import asyncio

    from podium import lockfile
    from podium.agent import facts
    from podium.agent.agent import Agent, AgentConfig
    from podium.timing import timing_from_env

    setup_logging(verbose)
    backends = list(dict.fromkeys(b.strip().lower() for b in backend if b.strip())) or ["process"]
    unknown = [b for b in backends if b not in ("process", "container")]
    if unknown:
        raise CliError(f"--backend {unknown[0]!r} is not a backend; use --backend process and/or --backend container")
    if container_host is not None and "container" not in backends:
        raise CliError("--container-host is for the container backend; add --backend container")
    sdir = state_dir or (default_data_dir() / "agent")
    node_labels = labels(label)
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
        labels=node_labels,
        cpu_millis=parse(parse_cpu, cpu, "--cpu") if cpu else facts.cpu_millis(),
        memory_bytes=parse(parse_size, memory, "--memory") if memory else facts.memory_bytes(),
        disk_bytes=facts.disk_bytes(sdir),
        slots=slots,
        max_operations=max_operations,
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
        answer_delay=float(os.environ.get("PODIUM_TEST_AGENT_ANSWER_DELAY", "0")),
        backends=backends,
        container_host=container_host or None,
    )
    node = Agent(cfg, facts.node_id(sdir), timing_from_env())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        freeze_startup()  # the agent and its backends are built: out of the collector's sight
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
    from podium.eventloop import run_loop
    from podium.heap import freeze_startup

    run_loop(main())


@app.command()
def dev(
    port: Annotated[int, typer.Option(help="REST API / UI port")] = 8642,
    grpc_port: Annotated[int, typer.Option(help="port the local agent connects to")] = 8643,
    data_dir: Annotated[Path | None, typer.Option(help="data directory (default: the user data dir)")] = None,
    demo: Annotated[bool, typer.Option(help="submit a first task and show it running")] = False,
    containers: Annotated[bool, typer.Option(
        "--containers", help="the local agent also runs container tasks while an engine is reachable (DOCKER_HOST, else the "
                             "default socket)")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Everything on this machine in one command: embedded PostgreSQL, a server and one local agent."""
    import asyncio

    from podium import lockfile
    from podium.client import token_file
    from podium.eventloop import run_loop
    from podium.server import PodiumServer, ServerConfig, install_signal_handlers

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

    run_loop(main())


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
    from podium.client import Client, LogChunk, PodiumError

    client = Client(addr)
    try:
        tid = client.submit(name="hello", command=[
            "sh", "-c", "echo hello from podium on $(hostname); for i in 1 2 3; do echo step $i; sleep 0.2; done"]).id
        out.print(f"[bold]Submitted a first task[/] {tid}; its output:")
        running_at = None
        for item in client.follow(tid):
            if isinstance(item, LogChunk):
                running_at = running_at or time.monotonic()
                for line in item.data.rstrip("\n").split("\n"):
                    out.print("  │ " + line, markup=False, highlight=False)
            else:
                out.print(f"  └ task {item.state} with exit code {item.exit_code}")
        if running_at:
            out.print(f"  (first output {running_at - t0:.2f}s after `podium dev` started)")
        out.print(f"  See it again: PODIUM_ADDR={addr} {escape(_me())} show {tid}", soft_wrap=True)
    except PodiumError as e:
        err.print(f"demo: {e}", markup=False)


@db_app.command("migrate")
def db_migrate(
    data_dir: Annotated[Path | None, typer.Option(help="data directory of the embedded PostgreSQL")] = None,
) -> None:
    """Apply the schema migrations (PODIUM_DATABASE_URL, or the embedded database)."""
    import asyncio

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

