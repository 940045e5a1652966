"""One Podium server: the store, the scheduler's loops, the agent gateway (gRPC) and the REST API,
in one asyncio process, supervised: a loop that dies stops the whole server loudly rather than leaving
a half-alive process that accepts work it will never place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from podium import metrics
from podium.api.app import create_app
from podium.api.ui import close as close_ui
from podium.gateway.service import Gateway
from podium.heap import freeze_startup
from podium.pressure import DEFAULT_MAX_LAG, Pressure
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.scheduler.apply import Applier
from podium.scheduler.reconcile import Reconciler
from podium.scheduler.resolver import ImageResolver, ResolveImage, registry_http_client
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox, load_key
from podium.security.service import Security
from podium.store import Store
from podium.store.db import DEFAULT_SERIALIZATION_RETRY_LIMIT
from podium.store.embedded import EmbeddedPostgres
from podium.timing import Timing, timing_from_env
from podium.wakeups import drain_wakeups

log = logging.getLogger(__name__)

DEFAULT_API_PORT = 8642
DEFAULT_GRPC_PORT = 8643


@dataclass
class ServerConfig:
    data_dir: Path
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    grpc_host: str = "127.0.0.1"
    grpc_port: int = DEFAULT_GRPC_PORT
    server_id: str = ""
    placement_policy: str = "spread"
    tls_cert: Path | None = None  # PEM; with tls_key, the API and the gateway speak TLS only
    tls_key: Path | None = None
    client_ca: Path | None = None  # PEM; agents must present a certificate it signed (mutual TLS)
    retention: float = 7 * 86400.0  # seconds finished tasks (with their events and logs) are kept
    max_lag: float = DEFAULT_MAX_LAG  # seconds of event-loop lag past which submissions are shed; 0: never
    # how often one store operation refused for contention is run again before it fails (503)
    serialization_retry_limit: int = DEFAULT_SERIALIZATION_RETRY_LIMIT
    # the most PostgreSQL connections this server opens: its four pools share what the listeners
    # (dispatch, gateway, events; about 5) leave, so replicas × this stays below max_connections
    db_connections: int = 40


LISTENER_CONNECTIONS = 5  # connections held for LISTEN (dispatch, gateway, revoked/superseded, events)
# the group commits' pool: two connections for each of the two group commits that may be applied at
# once (a batch's acceptances are made beside the rest of it), one for the outbox's takes, the log
# flushes and the release proofs
REPORTS_POOL = 5
OWN_CONNECTIONS = 2 + REPORTS_POOL + 2  # the pools of one job each: heartbeats 2, group commits, dispatch passes 1, the event hub 1
# the fewest `--db-connections` that keep its promise: the listeners, those pools, and 2 each for the
# API's and the node reports' pools
MIN_DB_CONNECTIONS = LISTENER_CONNECTIONS + OWN_CONNECTIONS + 4


class LoopDied(Exception):
    """A supervised loop ended; the server stops."""


class PodiumServer:
    def __init__(self, config: ServerConfig, timing: Timing | None = None, resolve_image: ResolveImage | None = None) -> None:
        self.cfg = config
        self.timing = timing or timing_from_env()
        # how image tags become digests: the registry's HTTP API v2 (tests of the loop pass their own)
        self.resolve_image = resolve_image or registry_http_client
        self.server_id = config.server_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.embedded: EmbeddedPostgres | None = None
        self.store: Store | None = None
        self.liveness_store: Store | None = None
        self.beats_store: Store | None = None
        self.reports_store: Store | None = None
        self.hub_store: Store | None = None
        self.dispatch_store: Store | None = None
        self.started = asyncio.Event()
        self.pressure = Pressure()
        self._stop = asyncio.Event()

    async def _database_url(self) -> str:
        if self.cfg.database_url:
            return self.cfg.database_url
        self.embedded = EmbeddedPostgres(self.cfg.data_dir)
        url = await asyncio.to_thread(self.embedded.start)
        await self.embedded.ensure_database(url)
        log.info("embedded PostgreSQL running in %s", self.embedded.pg_dir)
        return url

    def stop(self) -> None:
        self._stop.set()

    async def _watch_loop_lag(self) -> None:
        """How late a timer due now runs: the clearest single sign that the server has more ready work
        than one core can do (every node's heartbeat ack waits that long too). It feeds admission."""
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.process_time()
            await asyncio.sleep(LAG_PROBE)
            elapsed = loop.time() - t
            lag = max(0.0, elapsed - LAG_PROBE)
            metrics.LOOP_LAG_SECONDS.observe(lag)
            self.pressure.observe(lag, (time.process_time() - cpu) / max(elapsed, 1e-3))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self.embedded is not None:
                await asyncio.to_thread(self.embedded.stop)

    async def _run(self) -> None:
        url = await self._database_url()
        retry_limit = self.cfg.serialization_retry_limit
        # The pools' shares of the connection budget: the API two thirds, node reports a third,
        # heartbeats 2, the group commits 3, the dispatch passes 1 and the event hub's reads 1 (their
        # own, so nothing queues ahead of them).
        pools = max(MIN_DB_CONNECTIONS, self.cfg.db_connections) - LISTENER_CONNECTIONS
        main_max, liveness_max = max(2, (pools - OWN_CONNECTIONS) * 2 // 3), max(2, (pools - OWN_CONNECTIONS) // 3)
        store = self.store = await Store.connect(url, min_size=2, max_size=main_max, serialization_retry_limit=retry_limit)
        applied = await store.migrate()
        if applied:
            log.info("applied migrations: %s", ", ".join(applied))
        security = Security(store, SecretBox(load_key(self.cfg.data_dir)))
        await security.bootstrap(self.cfg.data_dir)
        # A pass runs on one connection, its statements by key (a batch of task ids, the nodes' ids):
        # a keyed pool, so no plan of theirs made while the tables were small scans a whole table on
        # every pass as they grow (the reservation still reads the nodes' primary key whole then)
        self.dispatch_store = await Store.connect(url, min_size=1, max_size=1, serialization_retry_limit=retry_limit, keyed=True)
        scheduler = Scheduler(
            store, self.timing, server_id=self.server_id, policy_name=self.cfg.placement_policy, retention=self.cfg.retention,
            dispatch_store=self.dispatch_store,
        )  # fmt: skip
        resolver = ImageResolver(store, security, self.timing, resolve=self.resolve_image, server_id=self.server_id)
        reconciler = Reconciler(store, scheduler.applier, self.timing, server_id=self.server_id)
        # Node reports and heartbeats get a pool of their own: a burst of API traffic must never
        # make a healthy node look silent, or a prompt accept look late.
        self.liveness_store = await Store.connect(url, min_size=2, max_size=liveness_max, serialization_retry_limit=retry_limit)
        # and heartbeats one more of their own, so no backlog of reports ever delays them; the
        # group commits of reports and the outbox takes one more, so no Hello storm delays those
        self.beats_store = await Store.connect(url, min_size=1, max_size=2, serialization_retry_limit=retry_limit)
        # (its statements' generic plans are lookups by key, tests/integration/test_plans.py: planned
        # once per session, not on every group commit)
        self.reports_store = await Store.connect(url, min_size=2, max_size=REPORTS_POOL, serialization_retry_limit=retry_limit, keyed=True,
                                                 generic_plans=True)  # fmt: skip
        # The event hub's one reader reads after every commit that writes events, and PostgreSQL planned
        # that read anew each time, its plan for the cursor's values estimated cheaper than the generic
        # one (an index walk from the cursor either way): ~1 ms to plan and 0.1 to run at 400,000 events.
        # A session of its own that plans it once (tests/integration/test_plans.py).
        self.hub_store = await Store.connect(url, min_size=1, max_size=1, serialization_retry_limit=retry_limit, keyed=True,
                                             generic_plans=True)  # fmt: skip
        # the gateway applies the policy's decisions on reports through the same applier the loops use,
        # over its own pool
        gateway = Gateway(
            self.liveness_store, Applier(self.liveness_store, actor=f"gateway:{self.server_id}"), self.timing, server_id=self.server_id,
            security=Security(self.liveness_store, security.box), beats_store=self.beats_store,
            reports_store=self.reports_store,
        )  # fmt: skip

        scheduler.hold_while_behind(gateway.behind)
        scheduler.deliver_through(gateway.sessions.keys, gateway.outbox.push, gateway)
        gateway.reports.place_on_ends(scheduler.dispatcher, gateway.outbox.push)

        drain_wakeups()  # a loop busy with the API still hears every stream's reads and writes in one turn
        grpc_server = grpc.aio.server(options=[("grpc.keepalive_time_ms", 20000), ("grpc.so_reuseport", 0)])
        pb_grpc.add_AgentGatewayServicer_to_server(gateway, grpc_server)
        address = f"{self.cfg.grpc_host}:{self.cfg.grpc_port}"
        if self.cfg.tls_cert and self.cfg.tls_key:
            creds = grpc.ssl_server_credentials(
                [(self.cfg.tls_key.read_bytes(), self.cfg.tls_cert.read_bytes())],
                root_certificates=self.cfg.client_ca.read_bytes() if self.cfg.client_ca else None,
                require_client_auth=self.cfg.client_ca is not None,
            )
            bound = grpc_server.add_secure_port(address, creds)
        else:
            bound = grpc_server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot listen for agents on {self.cfg.grpc_host}:{self.cfg.grpc_port}: the port is in use")
        await grpc_server.start()

        self.pressure = Pressure(max_lag=self.cfg.max_lag or float("inf"), backlog=lambda: gateway.report_backlog)
        app = create_app(store, scheduler, security, self.pressure, hub_store=self.hub_store)
        tls: dict[str, Any] = {}
        if self.cfg.tls_cert and self.cfg.tls_key:
            tls = {"ssl_certfile": str(self.cfg.tls_cert), "ssl_keyfile": str(self.cfg.tls_key)}
        ucfg = uvicorn.Config(app, host=self.cfg.host, port=self.cfg.port, log_level="warning", lifespan="off", **tls)
        api = uvicorn.Server(ucfg)
        api.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # we own the signals

        loops: dict[str, Callable[[], Awaitable[None]]] = {
            **scheduler.tasks(), **resolver.tasks(), **reconciler.tasks(), **gateway.tasks(),
            "api": api.serve, "server.lag": self._watch_loop_lag, "security.revocations": security.watch_revocations,
        }  # fmt: skip
        tasks: set[asyncio.Task[Any]] = {asyncio.create_task(_awaited(fn), name=name) for name, fn in loops.items()}
        stopper: asyncio.Task[Any] = asyncio.create_task(self._stop.wait(), name="stop")
        try:
            while not api.started:
                done = {t for t in tasks if t.done()}
                if done:
                    break
                await asyncio.sleep(0.02)
            if not any(t.done() for t in tasks):
                scheme = "https" if tls else "http"
                log.info("Podium server %s: API on %s://%s:%d, agents on %s:%d%s",
                         self.server_id, scheme, self.cfg.host, self.cfg.port, self.cfg.grpc_host, self.cfg.grpc_port,
                         "" if tls else " (no TLS: loopback use only)")  # fmt: skip
                self.started.set()
                freeze_startup()  # everything the server keeps is built: out of the collector's sight
            done, _ = await asyncio.wait(tasks | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            died = [t for t in done if t is not stopper]
            for t in died:
                exc = t.exception() if not t.cancelled() else None
                log.critical("loop %s stopped (%r); stopping the server", t.get_name(), exc)
            if died:
                raise LoopDied(f"loop {died[0].get_name()} stopped: {died[0].exception() if not died[0].cancelled() else 'cancelled'}")
        finally:
            api.should_exit = True
            close_ui(app)  # end the open event streams, or the API would wait for them to close
            stopper.cancel()
            for t in tasks:
                if t.get_name() != "api":
                    t.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await asyncio.gather(*tasks, return_exceptions=True)
            await grpc_server.stop(grace=1)
            await gateway.close()
            await scheduler.close()
            await resolver.close()
            await self.liveness_store.close()
            await self.beats_store.close()
            await self.reports_store.close()
            await self.dispatch_store.close()
            await self.hub_store.close()
            await store.close()


LAG_PROBE = 0.25  # seconds between probes of the event loop's lag


async def _awaited(loop: Callable[[], Awaitable[None]]) -> None:
    """A named loop as a coroutine of its own, for create_task."""
    await loop()


def install_signal_handlers(server: PodiumServer) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
