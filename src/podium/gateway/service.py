"""The gRPC side of the server: one `Connect` stream per node, wiring the parts that each own their state.

- `sessions`: the streams this replica holds, and what a Hello means (`Reconciler`);
- `reports`: node reports queued and group-committed (`ReportBatcher`), and release proofs;
- `outbox`: what nodes are owed, taken from the store and delivered;
- `liveness`: heartbeats and log chunks, each flushed in one statement per interval.

The gateway never decides anything from memory. A node's event becomes a compare-and-set checked
against the attempt's fencing token and the node's id, decided by the policy and applied by the one
applier; what a node must be sent is read from the store's outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

import grpc

from podium import metrics, reasons
from podium.errors import Forbidden, StoreUnavailable, Unauthorized
from podium.gateway.liveness import Heartbeats, LogFlusher
from podium.gateway.outbox import Outbox
from podium.gateway.reports import PERSIST_FOR, ReleaseProofs, ReportBatcher
from podium.gateway.sessions import Reconciler, Session, Sessions, check_hello, egress_of, streams_behind
from podium.gateway.snapshots import check_materializations, hello_facts, revalidate
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.protocol import fence_after, handover_after, take_batch
from podium.scheduler.apply import Applier
from podium.security.service import Security
from podium.store import Change, Store
from podium.store.rows import OutboxRow
from podium.timing import Timing

log = logging.getLogger(__name__)

MAX_ARTIFACTS = 4096  # image digests one node's inventory may list
# How long a dispatch that sent its Assigns before its COMMIT waits for their acceptances, to make
# them in its own transaction (`Gateway.accept_in_pass`): a node that takes longer has its acceptance
# committed on its own after the dispatch's, as before. Several of one stream's round trips here.
ACCEPT_IN_PASS_WAIT = 0.005  # seconds


class Gateway(pb_grpc.AgentGatewayServicer):
    def __init__(
        self,
        store: Store,
        applier: Applier,
        timing: Timing,
        *,
        server_id: str,
        security: Security,
        beats_store: Store | None = None,
        reports_store: Store | None = None,
    ) -> None:
        self.store = store
        self.security = security
        self.timing = timing
        self.server_id = server_id
        self.fence_after = fence_after(timing)
        self.handover_after = handover_after(timing)
        self.sessions = Sessions()
        # Heartbeats get connections of their own: however many node reports wait for the store,
        # a heartbeat flush never queues behind them. So do the group commits of reports and the
        # outbox takes: a storm of reconnecting nodes (thousands of Hellos, each a few queries) must
        # not hold up the reports of the nodes already working, or they miss their accept deadlines.
        reports_store = reports_store or store
        self.heartbeats = Heartbeats(beats_store or store, self.sessions, timing, server_id=server_id)
        self.logs = LogFlusher(reports_store, self.sessions)
        self.reports = ReportBatcher(reports_store, self.sessions, timing, logs=self.logs)
        self.proofs = ReleaseProofs(reports_store)
        self.outbox = Outbox(
            store, self.sessions, timing, take_store=reports_store, security=security, applier=applier
        )
        self.reconciler = Reconciler(store, applier, timing)
        # the stream each Assign sent before its dispatch's commit went on, until the commit is known
        self._sent_early: dict[int, Session] = {}

    @property
    def report_backlog(self) -> int:
        """Node reports received and not yet applied (admission reads it)."""
        return self.reports.backlog

    def behind(self) -> float:
        """Seconds an Assign placed now would wait on this replica before its node could accept it:
        behind the reports not yet committed (the acceptances queue there), or behind the writes
        still in progress on the streams (`sessions.streams_behind`). The dispatcher holds new
        placements while this is a large share of the accept deadline (`scheduler.dispatch.HOLD_SHARE`)."""
        now = time.monotonic()
        ages = [0.0 if s.writing_since is None else now - s.writing_since for s in self.sessions.values()]
        return max(self.reports.behind(), streams_behind(ages))

    def push_before_commit(self, rows: list[OutboxRow]) -> bool:
        """A dispatch's Assigns for streams held here, given before its COMMIT is sent: queued on their
        streams now, so an Assign travels to its node while the commit is flushed, not after it. False
        when they are not sent (the push after the commit sends them, as before). Whatever it
        answers, even by raising, the dispatch calls `commit_known` with the same rows once its
        commit is known.

        Safe before the commit because a node starts nothing before its `Accepted`, which only a
        recorded `provisioning` earns, and a `provisioning` is decided only once the dispatch's
        commit is known (`ReportBatcher.hold`): if the dispatch is not committed, the attempt does
        not exist, and the node is told to stop it as a stale one. Only Assigns that carry nothing
        from the store go this way (`Outbox.sendable_now`): no secret reaches a node for an
        assignment that may never be."""
        now = self.outbox.sendable_now(rows)
        if now is None:
            return False
        self.reports.hold([r.fencing_token for r in rows])
        self.outbox.send_now(now)
        for s, r, _spec in now:
            self._sent_early[r.fencing_token] = s
        return True

    async def accepted_before_write(self, tokens: list[int]) -> list[Change]:
        """The acceptances the nodes of these Assigns (sent by `push_before_commit` before their
        dispatch's write) return, waited for as `accept_in_pass` waits: the write makes them with the
        assignments, where a statement of their own after it was one round trip more."""
        return await self.reports.acceptances_in_pass(tokens, ACCEPT_IN_PASS_WAIT)

    async def accept_in_pass(self, rows: list[OutboxRow]) -> list[Change]:
        """The acceptances the nodes of these Assigns (sent by `push_before_commit`) return while
        their dispatch waits, for it to make in its own transaction (`ReportBatcher.acceptances_in_pass`):
        their `Accepted` then follows the one commit of the assignment and its acceptance."""
        return await self.reports.acceptances_in_pass([r.fencing_token for r in rows], ACCEPT_IN_PASS_WAIT)

    def commit_known(self, rows: list[OutboxRow], committed: Collection[int], accepted: Collection[int] = ()) -> None:
        """The dispatch that offered these rows to `push_before_commit` has committed, or failed:
        `committed` are the fencing tokens among them whose attempts it made (none if it failed; a
        pass that sent its Assigns before its write may have lost a node to another scheduler). The
        reports held for them are decided from now on, but for the acceptances it made itself
        (`accepted`), whose nodes are told at once. A committed Assign whose stream ended while the
        commit was on its way went nowhere: it goes the way of one pushed after the commit to a stream
        that ended (`Outbox.push`: handed back to whoever holds the node now, or sent on the node's new
        stream here)."""
        self.reports.release([r.fencing_token for r in rows], accepted=[t for t in accepted if t in committed])
        lost = [r for r in rows if (s := self._sent_early.pop(r.fencing_token, None)) is not None
                and self.sessions.get(r.node_id) is not s and r.fencing_token in committed]  # fmt: skip
        if lost:
            self.outbox.push(lost)

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {
            "gateway.heartbeats": self.heartbeats.loop,
            "gateway.logs": self.logs.loop,
            "gateway.outbox": self.outbox.loop,
            "gateway.events": self.reports.loop,
            "gateway.deliver": self.outbox.deliver_loop,
            "gateway.releases": self.proofs.loop,
        }

    async def close(self) -> None:
        for s in list(self.sessions.values()):
            s.close()
        await self.outbox.close()
        await self.logs.flush()
        with contextlib.suppress(StoreUnavailable):
            await self.store.release_gateway(self.server_id)

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
        problem = check_hello(hello) or check_materializations(hello)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        try:
            issued = await self.security.admit_node(hello.node_id, hello.credential, hello.instance_id)
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
                handover_after=self.handover_after, egress_contexts=egress_of(hello),
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
                self.sessions.supersede(old, hello.instance_id)
            else:
                old.close()
        if decided.superseded is not None:
            log.warning("node %s: agent instance %s supersedes instance %s", hello.node_id, hello.instance_id, decided.superseded)
        s = Session(hello.node_id, row.session, instance_id=hello.instance_id, batches=hello.batches)
        self.sessions[hello.node_id] = s
        metrics.CONNECTED_NODES.set(len(self.sessions))
        log.info("node %s (%s) connected, session %d", hello.name, hello.node_id, s.session)
        s.send(pb.ServerMessage(welcome=pb.Welcome(
            node_id=hello.node_id, server_id=self.server_id, heartbeat_seconds=self.timing.heartbeat,
            kill_grace_seconds=self.timing.kill_grace, fence_after_seconds=self.fence_after,
            node_credential=issued or "", batches=True,
        )))  # fmt: skip
        if row.draining:
            s.send(pb.ServerMessage(drain=pb.Drain(draining=True)))

        reader = asyncio.get_running_loop().create_task(self._read(s, hello, context), name=f"gateway.read.{hello.node_id}")
        try:
            await write_out(s, context.write)
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
            await self._persist(s, lambda: self.reconciler.reconcile(s, hello))
            self.outbox.due(s.node_id)
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                if msg.WhichOneof("kind") == "batch":
                    # in the order the node wrote them, exactly as if each had come on its own
                    for m in msg.batch.messages:
                        if m.WhichOneof("kind") in ("batch", "hello"):
                            log.warning("node %s sent a %s inside a batch; ignored", s.node_id, m.WhichOneof("kind"))
                            continue
                        await self._handle(s, m)
                else:
                    await self._handle(s, msg)
        except StoreUnavailable as e:
            log.warning("node %s: %s; closing its stream so it reconnects", s.node_id, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("node %s: stream reader failed", s.node_id)
        finally:
            s.close()
            self.reports.drop(s)

    async def _handle(self, s: Session, msg: pb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat":
            self.heartbeats.heard(s.node_id, s.session, msg.heartbeat.seq)
        elif kind == "event":
            await self.reports.enqueue(s, msg.event)
            if msg.event.kind == pb.TaskEvent.NOT_RUNNING:
                # "no such attempt here" also proves that no sandbox of it exists here: it
                # releases a container attempt that never reported one (revoked before it
                # started) — never one that did, whose proof must name the container
                self.proofs.add(s, pb.ReleaseProof(task_id=msg.event.task_id, fencing_token=msg.event.fencing_token,
                                                   released_at=time.time()))  # fmt: skip
        elif kind == "log":
            lc = msg.log
            try:
                tid = uuid.UUID(lc.task_id)
            except ValueError:
                return
            if lc.stream not in ("stdout", "stderr") or lc.seq < 0 or lc.offset < 0:
                # the table refuses it, and with it the whole flush of every node's output
                log.warning("node %s sent a malformed log chunk for task %s; dropped", s.node_id, tid)
                return
            self.logs.add(s.node_id, (tid, lc.fencing_token, lc.stream, lc.seq, lc.offset, lc.data))
        elif kind == "released":
            self.proofs.add(s, msg.released)
        elif kind == "inventory":
            await self._persist(s, functools.partial(self._inventory, s, list(msg.inventory.artifacts)))
        elif kind == "hello":
            log.warning("node %s sent a second Hello; ignored", s.node_id)

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

    async def _inventory(self, s: Session, artifacts: list[str]) -> None:
        """The image digests a node holds changed: placement prefers it for tasks pinned to them."""
        await self.store.set_artifacts(s.node_id, s.session, artifacts[:MAX_ARTIFACTS])


async def write_out(s: Session, write: Callable[[pb.ServerMessage], Awaitable[None]]) -> None:
    """Write what a stream's queue holds until its end (None). To an agent that reads batches (its
    Hello said so), everything queued at the moment of a write goes in that one write (a group
    commit's Accepteds and Acks, an outbox take's Assigns): one write and one read per side instead
    of one each per message. The Welcome goes first and alone: an agent reads it before anything else."""
    batches = False
    carry: pb.ServerMessage | None = None
    while True:
        msg, carry = (carry, None) if carry is not None else (await s.out.get(), None)
        if msg is None:
            return
        s.writing_since = time.monotonic()
        try:
            if not batches:
                await write(msg)
                batches = s.batches
                continue
            batch, carry, ended = take_batch(s.out, msg, pb.ServerMessage.ByteSize)
            await write(batch[0] if len(batch) == 1 else pb.ServerMessage(batch=pb.ServerBatch(messages=batch)))
        finally:
            s.writing_since = None
        if ended:
            return
