"""The gRPC side of the server: one `Connect` stream per node.

The gateway never decides anything from memory. A node's event becomes a compare-and-set checked
against the attempt's fencing token and the node's id; what a node must be sent (Assigns placed by any
server replica, stops) is read from the store's outbox when PostgreSQL notifies `podium_node`, with a
periodic sweep as the backstop, so a missed notification only delays and never loses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from podium import __version__
from podium.errors import Forbidden, NotFound, PodiumError, StoreUnavailable, Unauthorized
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.scheduler import policy
from podium.scheduler.service import Scheduler, facts
from podium.security.service import Security
from podium.states import TaskState
from podium.store import Store
from podium.timing import Timing
from podium import reasons

log = logging.getLogger(__name__)

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
LOG_FLUSH_SECONDS = 0.05
PERSIST_FOR = 30.0  # seconds a node's report is retried against an unavailable database
_KIND = {v: k for k, v in pb.TaskEvent.Kind.items()}


@dataclass(eq=False)
class Session:
    node_id: str
    session: int
    out: asyncio.Queue[pb.ServerMessage | None] = field(default_factory=asyncio.Queue)
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sync_again: bool = False
    revoked: bool = False
    last_ack: float = float("-inf")  # loop time of the last HeartbeatAck sent

    def send(self, msg: pb.ServerMessage) -> None:
        self.out.put_nowait(msg)

    def close(self) -> None:
        self.out.put_nowait(None)


class Gateway(pb_grpc.AgentGatewayServicer):
    def __init__(self, store: Store, scheduler: Scheduler, timing: Timing, *, server_id: str, security: Security) -> None:
        self.store = store
        self.security = security
        self._revoked_conn = None
        self.scheduler = scheduler
        self.timing = timing
        self.server_id = server_id
        self.sessions: dict[str, Session] = {}
        self._beats: dict[str, tuple[int, int]] = {}  # node → (session, latest heartbeat seq)
        self._logs: dict[str, list[tuple[uuid.UUID, int, str, int, bytes]]] = {}
        self._listen_conn = None
        self.events_rejected = 0
        # A node stops its attempts itself this long after its last acknowledged heartbeat: two
        # heartbeats before the server may declare it offline and give its work away.
        self.fence_after = max(timing.offline_after - 2 * timing.heartbeat, timing.offline_after / 2)

    # ---- loops ---------------------------------------------------------------------------------

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {
            "gateway.heartbeats": self.heartbeat_loop,
            "gateway.logs": self.log_loop,
            "gateway.outbox": self.outbox_loop,
        }

    async def heartbeat_loop(self) -> None:
        """Heartbeats are flushed in one statement per interval, not one per node."""
        interval = max(0.05, self.timing.heartbeat / 4)
        while True:
            await asyncio.sleep(interval)
            beats, self._beats = self._beats, {}
            if not beats:
                continue
            try:
                recorded = await self.store.heartbeats([(n, sess) for n, (sess, _seq) in beats.items()], self.server_id)
            except StoreUnavailable as e:
                # not acknowledged: the nodes' leases are not renewed, which is the truth
                log.warning("heartbeats not recorded: %s", e)
                continue
            for node_id in beats.keys() - recorded:
                live = self.sessions.get(node_id)
                if live is not None and live.session == beats[node_id][0]:
                    self._beats.setdefault(node_id, beats[node_id])  # its row was busy: next flush
            now = asyncio.get_running_loop().time()
            for node_id, (sess, seq) in beats.items():
                if node_id not in recorded:
                    continue
                s = self.sessions.get(node_id)
                # An ack renews the node's lease for fence_after from that heartbeat; acking every
                # one would be thousands of writes a second on a large fleet for no gain, so a node
                # is acked when its last ack is a quarter of the lease old.
                if s is not None and s.session == sess and now - s.last_ack >= self.fence_after / 4:
                    s.last_ack = now
                    s.send(pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq)))

    async def log_loop(self) -> None:
        while True:
            await asyncio.sleep(LOG_FLUSH_SECONDS)
            await self.flush_logs()

    async def flush_logs(self) -> None:
        pending, self._logs = self._logs, {}
        for node_id, chunks in pending.items():
            try:
                await self.store.insert_logs(node_id, chunks)
            except StoreUnavailable as e:
                log.warning("logs from %s not stored yet: %s", node_id, e)
                self._logs.setdefault(node_id, []).extend(chunks)
                continue
            # stored: the node may forget them (until now it keeps them, to send again if we die)
            s = self.sessions.get(node_id)
            if s is None:
                continue
            upto: dict[tuple[uuid.UUID, int, str], int] = {}
            for tid, token, stream, seq, _data in chunks:
                key = (tid, token, stream)
                upto[key] = max(upto.get(key, -1), seq)
            for (tid, token, stream), seq in upto.items():
                s.send(pb.ServerMessage(log_ack=pb.LogAck(task_id=str(tid), fencing_token=token, stream=stream, seq=seq)))

    async def outbox_loop(self) -> None:
        """LISTEN for per-node wake-ups, and sweep every node with a pending outbox as a backstop."""
        while True:
            try:
                if self._listen_conn is None or self._listen_conn.is_closed():
                    self._listen_conn = await self.store.listen("podium_node", self._on_node_notify)
                if self._revoked_conn is None or self._revoked_conn.is_closed():
                    self._revoked_conn = await self.store.listen("podium_revoked", self._on_revoked)
                for node_id in await self.store.nodes_with_outbox():
                    self._schedule_sync(node_id)
            except (StoreUnavailable, OSError) as e:
                log.warning("outbox sweep: %s", e)
                self._listen_conn = None
            await asyncio.sleep(max(self.timing.tick, 0.1))

    async def close(self) -> None:
        for s in list(self.sessions.values()):
            s.close()
        for conn in (self._listen_conn, self._revoked_conn):
            if conn is not None and not conn.is_closed():
                await conn.close()
        await self.flush_logs()
        with contextlib.suppress(StoreUnavailable):
            await self.store.release_gateway(self.server_id)

    def _on_revoked(self, node_id: str) -> None:
        s = self.sessions.get(node_id)
        if s is not None:
            log.warning("node %s was removed from the fleet; closing its stream", node_id)
            s.revoked = True
            s.close()

    def _on_node_notify(self, node_id: str) -> None:
        self._schedule_sync(node_id)

    def _schedule_sync(self, node_id: str) -> None:
        s = self.sessions.get(node_id)
        if s is None:
            return
        if s.sync_lock.locked():
            s.sync_again = True
            return
        asyncio.get_running_loop().create_task(self._sync(s), name=f"gateway.sync.{node_id}")

    async def _sync(self, s: Session) -> None:
        """Push what the store says this node is owed. Serialised per node."""
        async with s.sync_lock:
            while True:
                s.sync_again = False
                try:
                    rows = await self.store.take_outbox(s.node_id)
                except StoreUnavailable as e:
                    log.warning("outbox for %s: %s", s.node_id, e)
                    return
                for r in rows:
                    if r["kind"] == "assign":
                        await self._send_assign(s, r)
                    else:
                        s.send(pb.ServerMessage(cancel=pb.Cancel(
                            task_id=str(r["task_id"]), fencing_token=r["fencing_token"], reason=r["reason"] or "",
                        )))  # fmt: skip
                if not s.sync_again:
                    return

    async def _send_assign(self, s: Session, r: Any) -> None:
        """Resolve the task's secrets now, immediately before the Assign that carries them, and only
        for the node that runs this attempt."""
        spec = json.loads(r["spec"])
        try:
            values, registries = await self.security.resolve(spec)
        except (NotFound, PodiumError) as e:
            log.warning("task %s cannot be sent: %s", r["task_id"], e)
            await self.scheduler.apply(
                r["task_id"], TaskState.ASSIGNED,
                policy.Step(TaskState.FAILED, reasons.SECRET_MISSING, end_attempt=policy.A.REVOKED),
                fencing_token=r["fencing_token"],
            )  # fmt: skip
            return
        s.send(pb.ServerMessage(assign=pb.Assign(
            task_id=str(r["task_id"]), attempt=r["attempt"], fencing_token=r["fencing_token"],
            spec_json=r["spec"], gpu_indexes=list(r["gpu_indexes"] or ()),
            secrets=[pb.SecretValue(env=env, value=value) for env, value in values],
            registries=[pb.RegistryCredential(registry=h, username=u, password=p) for h, u, p in registries],
        )))  # fmt: skip

    # ---- the stream ----------------------------------------------------------------------------

    async def Connect(  # noqa: N802 - the name is the protocol's
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> None:
        # A coroutine handler with context.read()/write() rather than an async generator: the
        # stream's cleanup must be able to await the store without racing generator finalisation.
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message on a stream must be a Hello")
            return
        hello = first.hello
        problem = _check_hello(hello)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        try:
            issued = await self.security.admit_node(hello.node_id, hello.credential)
        except Forbidden as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            return
        except Unauthorized as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            return
        except StoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server cannot reach its database: {e}")
            return
        c = hello.capacity
        try:
            row = await self.store.node_hello(
                node_id=hello.node_id, name=hello.name or hello.node_id, pool=hello.pool or "default",
                arch=hello.arch or "x86_64", labels=dict(hello.labels), capabilities=sorted(hello.capabilities),
                backends=sorted(hello.backends) or ["process"], artifacts=sorted(hello.artifacts),
                protocol_min=hello.protocol_min or 1, protocol_max=hello.protocol_max or 1,
                gpu_indexes=list(hello.gpu_indexes), cpu_millis=c.cpu_millis, memory_bytes=c.memory_bytes,
                disk_bytes=c.disk_bytes, gpus=c.gpus, slots=c.slots, gateway_id=self.server_id,
                agent_version=hello.agent_version,
            )  # fmt: skip
        except StoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server cannot reach its database: {e}")
            return
        if row is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this node was removed from the fleet")
            return
        old = self.sessions.get(hello.node_id)
        if old is not None:
            old.close()
        s = Session(hello.node_id, row["session"])
        self.sessions[hello.node_id] = s
        log.info("node %s (%s) connected, session %d", hello.name, hello.node_id, s.session)
        s.send(pb.ServerMessage(welcome=pb.Welcome(
            node_id=hello.node_id, server_id=self.server_id, heartbeat_seconds=self.timing.heartbeat,
            kill_grace_seconds=self.timing.kill_grace, fence_after_seconds=self.fence_after,
            node_credential=issued or "",
        )))  # fmt: skip
        if row["draining"]:
            s.send(pb.ServerMessage(drain=pb.Drain(draining=True)))

        reader = asyncio.get_running_loop().create_task(self._read(s, hello, context), name=f"gateway.read.{hello.node_id}")
        try:
            while True:
                msg = await s.out.get()
                if msg is None:
                    break
                await context.write(msg)
            if s.revoked:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this node was removed from the fleet")
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.sessions.get(s.node_id) is s:
                del self.sessions[s.node_id]
                with contextlib.suppress(StoreUnavailable):
                    await self.store.node_disconnected(s.node_id, s.session)
                log.info("node %s disconnected", s.node_id)

    async def _read(self, s: Session, hello: pb.Hello, context: grpc.aio.ServicerContext) -> None:
        try:
            await self._persist(s, lambda: self._reconcile(s, hello))
            self._schedule_sync(s.node_id)
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("kind")
                if kind == "heartbeat":
                    self._beats[s.node_id] = (s.session, msg.heartbeat.seq)
                elif kind == "event":
                    ev = msg.event
                    await self._persist(s, lambda ev=ev: self._on_event(s, ev))  # type: ignore[misc]
                elif kind == "log":
                    lc = msg.log
                    try:
                        tid = uuid.UUID(lc.task_id)
                    except ValueError:
                        continue
                    self._logs.setdefault(s.node_id, []).append((tid, lc.fencing_token, lc.stream, lc.seq, lc.data))
                elif kind == "hello":
                    log.warning("node %s sent a second Hello; ignored", s.node_id)
        except StoreUnavailable as e:
            log.warning("node %s: %s; closing its stream so it reconnects", s.node_id, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("node %s: stream reader failed", s.node_id)
        finally:
            s.close()

    async def _persist(self, s: Session, op: Callable[[], Awaitable[None]]) -> None:
        """Run a store operation for a node, riding out a database blip without dropping the node's
        stream (a reconnect storm helps nobody); after PERSIST_FOR seconds, give up and let it reconnect.
        Every operation here is a compare-and-set, so running it again is safe."""
        delay = 0.05
        deadline = asyncio.get_running_loop().time() + PERSIST_FOR
        while True:
            try:
                await op()
                return
            except StoreUnavailable:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _reconcile(self, s: Session, hello: pb.Hello) -> None:
        """A (re)connecting node says what it still runs. Keep what is still its own, stop what is not,
        redeliver what it never received, and apply the node-loss policy to what it no longer has."""
        reported = {(rt.task_id, rt.fencing_token): rt for rt in hello.tasks}
        reported_tokens = {tok for (_t, tok) in reported}
        on_server = await self.store.tasks_on_node(s.node_id)
        current = {r["fencing_token"] for r in on_server}
        stale = [tok for tok in reported_tokens if tok not in current]
        if stale:
            # Still running something that is no longer its attempt: the server's truth wins.
            await self.store.request_stop(s.node_id, stale)
            for (tid, tok), rt in reported.items():
                if tok in stale and rt.phase != "exited":
                    s.send(pb.ServerMessage(cancel=pb.Cancel(task_id=tid, fencing_token=tok, reason="stale attempt")))
        redeliver = []
        for r in on_server:
            if r["fencing_token"] in reported_tokens:
                phase = reported[(str(r["id"]), r["fencing_token"])].phase if (str(r["id"]), r["fencing_token"]) in reported else ""
                if phase in ("provisioning", "running"):
                    # events sent on the old stream may have been lost with it: catch up from the report
                    for kind in (policy.PROVISIONING, policy.RUNNING)[: 1 if phase == "provisioning" else 2]:
                        row = await self.store.get_task(r["id"])
                        f = facts(row)
                        await self.scheduler.apply(r["id"], f.state, policy.on_node_event(f, kind, None, self.timing),
                                                   actor=f"node:{s.node_id}", fencing_token=r["fencing_token"], node_id=s.node_id)
                    row = await self.store.get_task(r["id"])
                    if row["state"] in _ACCEPTED and row["fencing_token"] == r["fencing_token"]:
                        self._accepted(s, str(r["id"]), r["fencing_token"])  # it may be waiting for this
                if r["state"] == TaskState.CANCELLING:
                    s.send(pb.ServerMessage(cancel=pb.Cancel(
                        task_id=str(r["id"]), fencing_token=r["fencing_token"], reason=reasons.CANCELLED)))  # fmt: skip
                continue
            if r["state"] == TaskState.ASSIGNED:
                redeliver.append(r["fencing_token"])
                continue
            row = await self.store.get_task(r["id"])
            f = facts(row)
            step = policy.on_node_loss(f, reasons.NODE_FORGOT)
            await self.scheduler.apply(
                r["id"], f.state, step, actor=f"node:{s.node_id}", fencing_token=r["fencing_token"], node_id=s.node_id
            )
        await self.store.redeliver(redeliver)

    def _accepted(self, s: Session, task_id: str, token: int) -> None:
        s.send(pb.ServerMessage(accepted=pb.Accepted(task_id=task_id, fencing_token=token)))

    async def _on_event(self, s: Session, ev: pb.TaskEvent) -> None:
        kind = _KIND.get(ev.kind, "")
        try:
            task_id = uuid.UUID(ev.task_id)
        except ValueError:
            log.warning("node %s sent an event for a malformed task id %r", s.node_id, ev.task_id)
            return
        final = kind in (policy.EXITED, policy.NOT_RUNNING, policy.FAILED_RETRYABLE)
        if final:
            # the attempt's output arrived before its end on this stream: store it before the end
            # becomes visible, so whoever follows the logs of an ended task has all of them
            await self.flush_logs()
        for _ in range(5):
            try:
                row = await self.store.get_task(task_id)
            except NotFound:
                row = None
            if row is None or row["fencing_token"] != ev.fencing_token or row["node_id"] != s.node_id:
                # A stale or foreign attempt: refuse it and make sure the node stops it.
                if row is not None and final and row["fencing_token"] == ev.fencing_token:
                    break  # already recorded (a resend after reconnect): just acknowledge
                self.events_rejected += 1
                log.warning(
                    "node %s: rejected %s for task %s with fencing token %d (the task is %s, token %s, on node %s)",
                    s.node_id, kind, ev.task_id, ev.fencing_token, None if row is None else row["state"],
                    None if row is None else row["fencing_token"], None if row is None else row["node_id"],
                )  # fmt: skip
                if not final:
                    s.send(pb.ServerMessage(cancel=pb.Cancel(
                        task_id=ev.task_id, fencing_token=ev.fencing_token, reason="stale attempt")))  # fmt: skip
                break
            f = facts(row)
            step = policy.on_node_event(f, kind, ev.exit_code if kind == policy.EXITED else None, self.timing)
            if step is None:
                if kind == policy.PROVISIONING and f.state in _ACCEPTED:
                    self._accepted(s, ev.task_id, ev.fencing_token)  # a repeat: it was recorded
                break
            done = await self.scheduler.apply(
                task_id, f.state, step, actor=f"node:{s.node_id}", fencing_token=ev.fencing_token, node_id=s.node_id
            )
            if done is not None:
                if kind == policy.PROVISIONING:
                    self._accepted(s, ev.task_id, ev.fencing_token)
                break
            # the task moved between the read and the write (a sweep, a cancel): read again
        if final:
            s.send(pb.ServerMessage(ack=pb.Ack(task_id=ev.task_id, fencing_token=ev.fencing_token)))


# States in which an attempt's "provisioning" has been recorded: the node may start it.
_ACCEPTED = (TaskState.PROVISIONING, TaskState.RUNNING)


def _check_hello(h: pb.Hello) -> str | None:
    if not h.node_id or len(h.node_id) > 128:
        return "Hello needs a node_id of 1 to 128 characters"
    if h.protocol_max and h.protocol_max < PROTOCOL_MIN or (h.protocol_min or 1) > PROTOCOL_MAX:
        return f"this server speaks agent protocol {PROTOCOL_MIN}..{PROTOCOL_MAX}; the agent speaks {h.protocol_min}..{h.protocol_max}"
    c = h.capacity
    if min(c.cpu_millis, c.memory_bytes, c.disk_bytes, c.gpus, c.slots) < 0:
        return "capacity values must be non-negative"
    return None


def server_version() -> str:
    return __version__
