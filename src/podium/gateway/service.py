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
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from podium import __version__, metrics
from podium.errors import Forbidden, NotFound, StoreUnavailable, Unauthorized
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.scheduler import policy
from podium.scheduler.service import Scheduler, facts
from podium.security.secretbox import SecretUnreadable
from podium.security.service import SecretMissing, Security
from podium.states import TaskState
from podium.gateway.snapshots import check_materializations, hello_facts, revalidate
from podium.store import Change, Store
from podium.timing import Timing
from podium import reasons

log = logging.getLogger(__name__)

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
LOG_FLUSH_SECONDS = 0.05
PERSIST_FOR = 30.0  # seconds a node's report is retried against an unavailable database
EVENT_BATCH = 1000  # node reports applied in one transaction (one commit) at most
MAX_ARTIFACTS = 4096  # image digests one node's inventory may list
EVENT_TRIES = 5  # a report whose task keeps moving between read and write is given up after this
SESSION_BACKLOG = 4096  # reports one stream may have waiting before its reader stops reading
_KIND = {v: k for k, v in pb.TaskEvent.Kind.items()}


@dataclass(eq=False, slots=True)
class Pending:
    """A node's report waiting for the next group commit."""

    event: pb.TaskEvent
    task_id: uuid.UUID
    kind: str
    tries: int = 0

    @property
    def final(self) -> bool:
        return self.kind in (policy.EXITED, policy.NOT_RUNNING, policy.FAILED_RETRYABLE)


@dataclass(eq=False)
class Session:
    node_id: str
    session: int
    out: asyncio.Queue[pb.ServerMessage | None] = field(default_factory=asyncio.Queue)
    revoked: bool = False
    last_ack: float = float("-inf")  # loop time of the last HeartbeatAck sent
    events: deque[Pending] = field(default_factory=deque)  # reports in arrival order, not yet applied
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set while the backlog is below the limit
    instance_id: str = ""  # the agent process on the other end ("" from an agent too old to say)

    def send(self, msg: pb.ServerMessage) -> None:
        self.out.put_nowait(msg)

    def close(self) -> None:
        self.out.put_nowait(None)


class Gateway(pb_grpc.AgentGatewayServicer):
    def __init__(
        self,
        store: Store,
        scheduler: Scheduler,
        timing: Timing,
        *,
        server_id: str,
        security: Security,
        beats_store: Store | None = None,
        reports_store: Store | None = None,
    ) -> None:
        self.store = store
        # Heartbeats get connections of their own: however many node reports wait for the store,
        # a heartbeat flush never queues behind them. So do the group commits of reports and the
        # outbox takes: a storm of reconnecting nodes (thousands of Hellos, each a few queries) must
        # not hold up the reports of the nodes already working, or they miss their accept deadlines.
        self.beats_store = beats_store or store
        self.reports_store = reports_store or store
        self.security = security
        self._revoked_conn = None  # also hears podium_superseded
        self.scheduler = scheduler
        self.timing = timing
        self.server_id = server_id
        self.sessions: dict[str, Session] = {}
        self._beats: dict[str, tuple[int, int]] = {}  # node → (session, latest heartbeat seq)
        # node → (task, token, stream, seq, offset, data) chunks received and not yet stored, in arrival order
        self._logs: dict[str, list[tuple[uuid.UUID, int, str, int, int, bytes]]] = {}
        # One flush at a time: a chunk put back after a failed flush is stored (and acknowledged)
        # before any that came after it, and a flush that returns has stored all received before it.
        self._flush_lock = asyncio.Lock()
        self._listen_conn = None
        self.events_rejected = 0
        # sessions with reports waiting, in the order they are served (round robin)
        self._event_sessions: dict[Session, None] = {}
        self._events_ready = asyncio.Event()
        self.report_backlog = 0  # node reports received and not yet applied (admission reads it)
        self._outbox_due: set[str] = set()  # nodes to take the outbox of at the next take
        self._outbox_wake = asyncio.Event()
        # release proofs received and not yet recorded: (task, token, node, backend ref, released at)
        self._proofs: list[tuple[uuid.UUID, int, str, str, float]] = []
        self._proofs_ready = asyncio.Event()
        # A node stops its attempts itself this long after its last acknowledged heartbeat: two
        # heartbeats before the server may declare it offline and give its work away.
        self.fence_after = max(timing.offline_after - 2 * timing.heartbeat, timing.offline_after / 2)
        # After another instance takes a node over, the attempts it does not report stay the node's
        # this long past the old instance's last recorded heartbeat: its own fence deadline (which runs
        # from when it *sent* that heartbeat, earlier) plus a heartbeat for the fence keeper to act.
        self.handover_after = self.fence_after + timing.heartbeat

    # ---- loops ---------------------------------------------------------------------------------

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {
            "gateway.heartbeats": self.heartbeat_loop,
            "gateway.logs": self.log_loop,
            "gateway.outbox": self.outbox_loop,
            "gateway.events": self.event_loop,
            "gateway.deliver": self.deliver_loop,
            "gateway.releases": self.release_loop,
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
                with metrics.HEARTBEAT_FLUSH_SECONDS.time():
                    recorded = await self.beats_store.heartbeats([(n, sess) for n, (sess, _seq) in beats.items()], self.server_id)
            except StoreUnavailable as e:
                # not acknowledged: the nodes' leases are not renewed, which is the truth
                log.warning("heartbeats not recorded: %s", e)
                continue
            # a heartbeat not recorded came on a session that is no longer the node's (or from a node
            # removed from the fleet): it renews nothing and is not acknowledged
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

    async def flush_logs(self) -> bool:
        """Store the log chunks of every node received since the last flush, in one statement.
        False if they could not be stored (they are kept, in order, for the next flush)."""
        async with self._flush_lock:
            return await self._flush_logs()

    async def _flush_logs(self) -> bool:
        pending, self._logs = self._logs, {}
        if not pending:
            return True
        try:
            await self.reports_store.insert_logs([(*c, node_id) for node_id, chunks in pending.items() for c in chunks])
        except StoreUnavailable as e:
            log.warning("logs from %d nodes not stored yet: %s", len(pending), e)
            for node_id, chunks in pending.items():
                self._logs[node_id] = chunks + self._logs.get(node_id, [])
            return False
        # stored: the nodes may forget them (until now each keeps them, to send again if we die)
        for node_id, chunks in pending.items():
            s = self.sessions.get(node_id)
            if s is None:
                continue
            upto: dict[tuple[uuid.UUID, int, str], int] = {}
            for tid, token, stream, seq, _offset, _data in chunks:
                key = (tid, token, stream)
                upto[key] = max(upto.get(key, -1), seq)
            for (tid, token, stream), seq in upto.items():
                s.send(pb.ServerMessage(log_ack=pb.LogAck(task_id=str(tid), fencing_token=token, stream=stream, seq=seq)))
        return True

    async def release_loop(self) -> None:
        """Record nodes' release proofs: every proof received since the last pass in one statement.
        A proof is a compare-and-set on its attempt (task, token, node), so recording one twice, or
        after the node-loss policy released the attempt, changes nothing."""
        delay = 0.05
        while True:
            await self._proofs_ready.wait()
            self._proofs_ready.clear()
            pending, self._proofs = self._proofs, []
            if not pending:
                continue
            try:
                accepted = await self.reports_store.release_proofs(pending)
            except StoreUnavailable as e:
                log.warning("%d release proofs not recorded yet: %s", len(pending), e)
                self._proofs = pending + self._proofs
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._proofs_ready.set()
                continue
            delay = 0.05
            metrics.RELEASE_PROOFS.labels("accepted").inc(len(accepted))
            metrics.RELEASE_PROOFS.labels("refused").inc(len(pending) - len(accepted))
            taken = {(t, tok) for t, tok, _freed in accepted}
            for tid, tok, node_id, _ref, _at in pending:
                if (tid, tok) not in taken:
                    log.info("node %s: release proof for task %s token %d refused (not its attempt, or already released)",
                             node_id, tid, tok)  # fmt: skip

    def _add_proof(self, s: Session, proof: pb.ReleaseProof) -> None:
        try:
            tid = uuid.UUID(proof.task_id)
        except ValueError:
            log.warning("node %s sent a release proof for a malformed task id %r", s.node_id, proof.task_id)
            return
        # the node's clock is only recorded, never compared; a value that is no time at all is dropped
        at = proof.released_at if math.isfinite(proof.released_at) and 0 <= proof.released_at < 1e11 else 0.0
        self._proofs.append((tid, proof.fencing_token, s.node_id, proof.backend_ref, at))
        self._proofs_ready.set()

    async def _inventory(self, s: Session, artifacts: list[str]) -> None:
        """The image digests a node holds changed: placement prefers it for tasks pinned to them."""
        await self.store.set_artifacts(s.node_id, s.session, artifacts[:MAX_ARTIFACTS])

    async def outbox_loop(self) -> None:
        """LISTEN for per-node wake-ups, and sweep every node with a pending outbox as a backstop."""
        while True:
            try:
                if self._listen_conn is None or self._listen_conn.is_closed():
                    self._listen_conn = await self.store.listen("podium_node", self._on_node_notify)
                if self._revoked_conn is None or self._revoked_conn.is_closed():
                    self._revoked_conn = await self.store.listen(
                        "podium_revoked", self._on_revoked, also={"podium_superseded": self._on_superseded}
                    )
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

    def _on_superseded(self, payload: str) -> None:
        """Another instance said Hello for a node, maybe on another replica: if this replica holds the
        old instance's stream, tell it so and close it. (A missed notification is safe: the old
        stream's heartbeats no longer match the node's session, so nothing renews its lease, and it
        fences itself by its deadline; the server waits for that deadline before giving its work away.)"""
        try:
            note = json.loads(payload)
            node_id, old, new = note["node"], note["old"], note["new"]
        except (ValueError, KeyError, TypeError):
            log.warning("malformed podium_superseded notification %r", payload)
            return
        s = self.sessions.get(node_id)
        if s is not None and s.instance_id == old:
            self._supersede(s, new)

    def _supersede(self, s: Session, new_instance: str) -> None:
        log.warning("node %s: agent instance %s was superseded by instance %s; telling it to stop", s.node_id, s.instance_id, new_instance)
        s.send(pb.ServerMessage(superseded=pb.Superseded(reason=reasons.SUPERSEDED, instance_id=new_instance)))
        s.close()

    def _on_node_notify(self, node_id: str) -> None:
        self._schedule_sync(node_id)

    def _schedule_sync(self, node_id: str) -> None:
        if node_id in self.sessions:
            self._outbox_due.add(node_id)
            self._outbox_wake.set()

    async def deliver_loop(self) -> None:
        """Push what the store says nodes are owed: every node woken since the last take, in one
        statement (a dispatch batch spread over a thousand nodes is one take, not a thousand).

        An Assign whose secrets could not be read because the store was unavailable is kept here
        and sent again (with backoff) on the same stream: the take already marked it delivered, so
        no other take would return it, and failing the task over a database blip would be a lie.
        Should this server die meanwhile, the node's next Hello has it redelivered."""
        delay = 0.05
        retry: list[tuple[Session, Any]] = []  # (stream, outbox row) to send again, oldest first
        retry_delay = 0.05
        while True:
            if retry:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._outbox_wake.wait(), timeout=retry_delay)
            else:
                await self._outbox_wake.wait()
            self._outbox_wake.clear()
            due, self._outbox_due = self._outbox_due, set()
            live = sorted(n for n in due if n in self.sessions)
            rows: list[Any] = []
            if live:
                try:
                    with metrics.OUTBOX_TAKE_SECONDS.time():
                        rows = await self.reports_store.take_outbox(live)
                except StoreUnavailable as e:
                    log.warning("outbox for %d nodes: %s", len(live), e)
                    self._outbox_due.update(live)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    self._outbox_wake.set()
                    continue
                delay = 0.05
            # what waited for the store first, each still only on the stream it was taken for (a
            # node that reconnected since is redelivered its Assigns by its Hello)
            work = [(s, r, True) for s, r in retry if self.sessions.get(s.node_id) is s]
            retry = []
            work += [(s, r, False) for r in rows if (s := self.sessions.get(r["node_id"])) is not None]
            for s, r, again in work:
                if r["kind"] == "assign":
                    # marked delivered but not sent if this fails: closing the stream makes the
                    # node's next Hello redeliver it
                    try:
                        if not await self._send_assign(s, r, again=again):
                            retry.append((s, r))
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        log.exception("sending task %s to node %s failed; closing its stream", r["task_id"], s.node_id)
                        s.close()
                else:
                    s.send(pb.ServerMessage(cancel=pb.Cancel(
                        task_id=str(r["task_id"]), fencing_token=r["fencing_token"], reason=r["reason"] or "",
                    )))  # fmt: skip
            retry_delay = min(retry_delay * 2, 1.0) if retry else 0.05

    async def _send_assign(self, s: Session, r: Any, *, again: bool = False) -> bool:
        """Resolve the task's secrets now, immediately before the Assign that carries them, and only
        for the node that runs this attempt. False when the store could not be read: nothing is
        known yet, and the caller sends it again. With `again`, the attempt is first checked to
        still be the task's current one (it may have been cancelled or revoked while it waited)."""
        task_id, token = r["task_id"], r["fencing_token"]
        spec = json.loads(r["spec"])
        try:
            if again:
                current = await self.store.get_task(task_id)
                if current["state"] != TaskState.ASSIGNED or current["fencing_token"] != token:
                    return True  # moved on while it waited: nothing to send
            values, registries = await self.security.resolve(spec)
        except StoreUnavailable as e:
            log.warning("task %s: its secrets cannot be read now (%s); sending it to node %s again shortly", task_id, e, s.node_id)
            return False
        except SecretMissing as e:
            log.warning("task %s cannot be sent: %s", task_id, e)
            return await self._undeliverable(r, policy.SECRET_GONE, {"secret": e.secret})
        except SecretUnreadable as e:
            log.error("task %s cannot be sent to node %s: %s; every replica must be given the same key "
                      "(PODIUM_SECRET_KEY or PODIUM_SECRET_KEY_FILE)", task_id, s.node_id, e)  # fmt: skip
            return await self._undeliverable(r, policy.SECRET_UNREADABLE, {"secret": e.secret, "key_id": e.key_id})
        except NotFound:
            return True  # the task itself is gone (pruned): nothing to send
        s.send(pb.ServerMessage(assign=pb.Assign(
            task_id=str(task_id), attempt=r["attempt"], fencing_token=token,
            spec_json=r["spec"], gpu_indexes=list(r["gpu_indexes"] or ()),
            secrets=[pb.SecretValue(env=env, value=value) for env, value in values],
            registries=[pb.RegistryCredential(registry=h, username=u, password=p) for h, u, p in registries],
        )))  # fmt: skip
        return True

    async def _undeliverable(self, r: Any, problem: str, detail: dict[str, Any]) -> bool:
        """Apply the policy's step for an Assign that cannot be sent; the detail (which secret, which
        key) goes beside the reason, in the audit log, never into it. False if the store went away
        meanwhile (the caller tries the whole delivery again)."""
        step = policy.on_undeliverable(policy.TaskFacts(state=TaskState.ASSIGNED), problem)
        try:
            done = await self.scheduler.apply(r["task_id"], TaskState.ASSIGNED, step, fencing_token=r["fencing_token"])
            if done is not None and step is not None:
                await self.store.audit(
                    f"gateway:{self.server_id}", "task.undeliverable", str(r["task_id"]),
                    {"reason": step.reason, "fencing_token": r["fencing_token"], **detail},
                )  # fmt: skip
        except StoreUnavailable as e:
            log.warning("task %s: its failure could not be recorded yet (%s); trying again", r["task_id"], e)
            return False
        return True

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
        problem = _check_hello(hello) or check_materializations(hello)
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
            decided = await self.store.instance_hello(
                node_id=hello.node_id, name=hello.name or hello.node_id, pool=hello.pool or "default",
                arch=hello.arch or "x86_64", labels=dict(hello.labels), capabilities=sorted(hello.capabilities),
                backends=sorted(hello.backends) or ["process"], artifacts=sorted(hello.artifacts),
                protocol_min=hello.protocol_min or 1, protocol_max=hello.protocol_max or 1,
                gpu_indexes=list(hello.gpu_indexes), cpu_millis=c.cpu_millis, memory_bytes=c.memory_bytes,
                disk_bytes=c.disk_bytes, gpus=c.gpus, slots=c.slots, gateway_id=self.server_id,
                agent_version=hello.agent_version, instance_id=hello.instance_id, peer=context.peer() or "",
                handover_after=self.handover_after, egress_contexts=_egress_of(hello),
                enforces_limits=hello.enforces_limits, **hello_facts(hello),
            )  # fmt: skip
        except StoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server cannot reach its database: {e}")
            return
        if decided.refused_by is not None:
            # An instance that was superseded comes back (it missed the word, or was frozen): it must
            # not take the node back, or two copies would knock each other off for ever.
            log.warning("node %s: refused agent instance %s, superseded by %s", hello.node_id, hello.instance_id, decided.refused_by)
            await context.write(pb.ServerMessage(superseded=pb.Superseded(reason=reasons.SUPERSEDED, instance_id=decided.refused_by)))
            return
        row = decided.row
        if row is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this node was removed from the fleet")
            return
        # a runtime that changed under the node's attempts: they are rechecked now. If the store is
        # away, the reconcile loop still finds the change at its next regular check of each attempt.
        with contextlib.suppress(StoreUnavailable):
            await revalidate(self.store, hello.node_id, decided.materializations_before, hello)
        old = self.sessions.get(hello.node_id)
        if old is not None:
            if decided.superseded is not None and old.instance_id == decided.superseded:
                self._supersede(old, hello.instance_id)
            else:
                old.close()
        if decided.superseded is not None:
            log.warning("node %s: agent instance %s supersedes instance %s", hello.node_id, hello.instance_id, decided.superseded)
        s = Session(hello.node_id, row["session"], instance_id=hello.instance_id)
        self.sessions[hello.node_id] = s
        metrics.CONNECTED_NODES.set(len(self.sessions))
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
                metrics.CONNECTED_NODES.set(len(self.sessions))
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
                    await self._enqueue_event(s, msg.event)
                    if msg.event.kind == pb.TaskEvent.NOT_RUNNING:
                        # "no such attempt here" also proves that no sandbox of it exists here: it
                        # releases a container attempt that never reported one (revoked before it
                        # started) — never one that did, whose proof must name the container
                        self._add_proof(s, pb.ReleaseProof(task_id=msg.event.task_id, fencing_token=msg.event.fencing_token,
                                                           released_at=time.time()))  # fmt: skip
                elif kind == "log":
                    lc = msg.log
                    try:
                        tid = uuid.UUID(lc.task_id)
                    except ValueError:
                        continue
                    if lc.stream not in ("stdout", "stderr") or lc.seq < 0 or lc.offset < 0:
                        # the table refuses it, and with it the whole flush of every node's output
                        log.warning("node %s sent a malformed log chunk for task %s; dropped", s.node_id, tid)
                        continue
                    self._logs.setdefault(s.node_id, []).append(
                        (tid, lc.fencing_token, lc.stream, lc.seq, lc.offset, lc.data))  # fmt: skip
                elif kind == "released":
                    self._add_proof(s, msg.released)
                elif kind == "inventory":
                    await self._persist(s, lambda: self._inventory(s, list(msg.inventory.artifacts)))
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
            # what it reported and we did not apply yet goes with the stream: a reconnecting node
            # reports its attempts again, and re-sends every end not acknowledged
            self._backlog_add(-len(s.events))
            s.events.clear()
            self._event_sessions.pop(s, None)

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
        gone: list[Any] = []  # on the node by the server's word, not in this Hello
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
            gone.append(r)
        # While another instance that may still run them has not passed its fence deadline (the
        # node was just taken over), what this one does not report is neither redelivered nor given
        # away: the watchdog applies the node-loss policy once that deadline has passed. Assignments
        # never pushed to any stream are no other instance's: they go to this one as usual.
        if gone:
            fresh = await self.store.undelivered_on_node(s.node_id)
            held = [r["fencing_token"] for r in gone if r["fencing_token"] not in fresh]
            if held and await self.store.defer_node_loss(s.node_id, held):
                log.warning("node %s: %d attempts wait for the fence deadline of the instance this one superseded", s.node_id, len(held))
                gone = [r for r in gone if r["fencing_token"] in fresh]
        for r in gone:
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

    # ---- node reports, group-committed ---------------------------------------------------------

    def _backlog_add(self, n: int) -> None:
        self.report_backlog += n
        metrics.NODE_REPORT_BACKLOG.inc(n)

    async def _enqueue_event(self, s: Session, ev: pb.TaskEvent) -> None:
        """Queue a report for the next group commit, and go on reading the stream (its heartbeats
        must not wait behind its reports). A node that reports faster than the store takes it is
        slowed by gRPC flow control: its reader waits while its backlog is full."""
        try:
            task_id = uuid.UUID(ev.task_id)
        except ValueError:
            log.warning("node %s sent an event for a malformed task id %r", s.node_id, ev.task_id)
            return
        while len(s.events) >= SESSION_BACKLOG:
            s.room.clear()
            await s.room.wait()
        s.events.append(Pending(ev, task_id, _KIND.get(ev.kind, "")))
        self._backlog_add(1)
        self._event_sessions.setdefault(s, None)
        self._events_ready.set()

    async def event_loop(self) -> None:
        """Apply node reports in batches: every report that arrived while the last batch was being
        committed goes into the next one, so a busy fleet costs a commit per batch, not per report.
        Each report is still its own compare-and-set, decided from the row just read."""
        delay = 0.05
        down_since: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            await self._events_ready.wait()
            self._events_ready.clear()
            while batch := self._take_batch():
                try:
                    with metrics.NODE_REPORT_BATCH_SECONDS.time():
                        await self._apply_batch(batch)
                except StoreUnavailable as e:
                    self._put_back(batch)
                    now = loop.time()
                    down_since = now if down_since is None else down_since
                    if now - down_since > PERSIST_FOR:
                        # a node whose reports cannot be stored for this long reconnects and reports again
                        log.warning("node reports not stored for %.0fs (%s); closing the streams that sent them", now - down_since, e)
                        for sess in list(self._event_sessions):
                            sess.close()
                        down_since = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # A bug, or a write the database refused for good: it must not take the other
                    # nodes' reports (or the server) with it. The streams that sent this batch are
                    # closed; on reconnect their nodes report their attempts again, as after any loss.
                    log.exception("applying %d node reports failed; closing the streams that sent them", len(batch))
                    for sess in {s for s, _p in batch}:
                        sess.close()
                    continue
                delay, down_since = 0.05, None

    def _take_batch(self) -> list[tuple[Session, Pending]]:
        """Up to EVENT_BATCH reports, round robin over the streams, each stream's in arrival order,
        at most one per task (a later report on the same task waits for the next batch)."""
        batch: list[tuple[Session, Pending]] = []
        tasks: set[uuid.UUID] = set()
        active = list(self._event_sessions)
        served: list[Session] = []
        while active and len(batch) < EVENT_BATCH:
            again = []
            for s in active:
                if len(batch) >= EVENT_BATCH:
                    break
                if not s.events or s.events[0].task_id in tasks:
                    continue
                p = s.events.popleft()
                self._backlog_add(-1)
                tasks.add(p.task_id)
                batch.append((s, p))
                again.append(s)
            served.extend(again)
            active = again
        for s in dict.fromkeys(served):
            self._requeue_session(s)
        return batch

    def _requeue_session(self, s: Session) -> None:
        """Move a stream to the back of the service order (or out of it when it has nothing left)."""
        self._event_sessions.pop(s, None)
        if len(s.events) < SESSION_BACKLOG:
            s.room.set()
        if s.events and self.sessions.get(s.node_id) is s:
            self._event_sessions[s] = None

    def _put_back(self, items: list[tuple[Session, Pending]]) -> None:
        """Reports that must be tried again go back to the front of their stream's queue, in order."""
        for s, p in reversed(items):
            if self.sessions.get(s.node_id) is s:
                s.events.appendleft(p)
                self._backlog_add(1)
                self._event_sessions.setdefault(s, None)
        if items:
            self._events_ready.set()

    async def _apply_batch(self, batch: list[tuple[Session, Pending]]) -> None:
        if any(p.final for _s, p in batch):
            # an attempt's output arrived before its end on the same stream: store it before the end
            # becomes visible, so whoever follows the logs of an ended task has all of them (and the
            # node, told its end is recorded, forgets no output that is not)
            if not await self.flush_logs():
                raise StoreUnavailable("the output sent before these ends is not stored yet")
        rows = await self.reports_store.task_facts_many([p.task_id for _s, p in batch])
        changes: list[Change] = []
        planned: list[tuple[Session, Pending]] = []
        for s, p in batch:
            ev = p.event
            row = rows.get(p.task_id)
            if row is None or row["fencing_token"] != ev.fencing_token or row["node_id"] != s.node_id:
                if not (row is not None and p.final and row["fencing_token"] == ev.fencing_token):
                    # a stale or foreign attempt: refuse it, and make sure the node stops it
                    self._reject(s, p, row)
                else:
                    metrics.NODE_REPORTS.labels("settled").inc()
                # (an end already recorded, sent again after a reconnect, is only acknowledged)
                self._answer(s, p, applied=False)
                continue
            f = facts(row)
            step = policy.on_node_event(
                f, p.kind, ev.exit_code if p.kind == policy.EXITED else None, self.timing,
                failure_class=ev.failure_class, message=ev.message,
            )  # fmt: skip
            if step is None:
                if p.kind == policy.PROVISIONING and f.state in _ACCEPTED:
                    self._accepted(s, ev.task_id, ev.fencing_token)  # a repeat: it was recorded
                metrics.NODE_REPORTS.labels("settled").inc()
                self._answer(s, p, applied=False)
                continue
            changes.append(Change(
                p.task_id, f.state, step.to, actor=f"node:{s.node_id}", reason=step.reason,
                fencing_token=ev.fencing_token, node_id=s.node_id, exit_code=step.exit_code,
                lease_seconds=step.lease_seconds, end_attempt=step.end_attempt,
                attempt_state=step.attempt_state, stop=step.stop, failure_class=step.failure_class,
                detail=step.detail, backend_ref=ev.backend_ref or None, release=step.release,
            ))  # fmt: skip
            planned.append((s, p))
        results = await self.reports_store.transition_many(changes) if changes else []
        metrics.NODE_REPORT_BATCH.observe(len(batch))
        again: list[tuple[Session, Pending]] = []
        for (s, p), done in zip(planned, results, strict=True):
            if done is not None:
                metrics.NODE_REPORTS.labels("applied").inc()
                self._answer(s, p, applied=True)
                continue
            # the task moved between the read and the write (a sweep, a cancel): decide again
            p.tries += 1
            if p.tries < EVENT_TRIES:
                again.append((s, p))
            else:
                log.warning("node %s: %s for task %s kept losing races; dropped", s.node_id, p.kind, p.task_id)
                metrics.NODE_REPORTS.labels("dropped").inc()
                self._answer(s, p, applied=False)
        self._put_back(again)

    def _reject(self, s: Session, p: Pending, row: Any) -> None:
        self.events_rejected += 1
        metrics.NODE_REPORTS.labels("rejected").inc()
        ev = p.event
        log.warning(
            "node %s: rejected %s for task %s with fencing token %d (the task is %s, token %s, on node %s)",
            s.node_id, p.kind, ev.task_id, ev.fencing_token, None if row is None else row["state"],
            None if row is None else row["fencing_token"], None if row is None else row["node_id"],
        )  # fmt: skip
        if not p.final:
            s.send(pb.ServerMessage(cancel=pb.Cancel(task_id=ev.task_id, fencing_token=ev.fencing_token, reason="stale attempt")))

    def _answer(self, s: Session, p: Pending, *, applied: bool) -> None:
        """What the node hears once its report is settled: Accepted when its provisioning was just
        recorded (it may start the attempt), and an Ack for every end (it may forget it)."""
        if applied and p.kind == policy.PROVISIONING:
            self._accepted(s, p.event.task_id, p.event.fencing_token)
        if p.final:
            s.send(pb.ServerMessage(ack=pb.Ack(task_id=p.event.task_id, fencing_token=p.event.fencing_token)))


# States in which an attempt's "provisioning" has been recorded: the node may start it.
_ACCEPTED = (TaskState.PROVISIONING, TaskState.RUNNING)


def _egress_of(h: pb.Hello) -> list[str]:
    """The egress contexts a node declared; one that declares none has what any process has."""
    return sorted(set(h.egress_contexts)) or ["open"]


def _check_hello(h: pb.Hello) -> str | None:
    if not h.node_id or len(h.node_id) > 128:
        return "Hello needs a node_id of 1 to 128 characters"
    if len(h.instance_id) > 256:
        return "Hello's instance_id must be at most 256 characters"
    if h.protocol_max and h.protocol_max < PROTOCOL_MIN or (h.protocol_min or 1) > PROTOCOL_MAX:
        return f"this server speaks agent protocol {PROTOCOL_MIN}..{PROTOCOL_MAX}; the agent speaks {h.protocol_min}..{h.protocol_max}"
    c = h.capacity
    if min(c.cpu_millis, c.memory_bytes, c.disk_bytes, c.gpus, c.slots) < 0:
        return "capacity values must be non-negative"
    return None


def server_version() -> str:
    return __version__
