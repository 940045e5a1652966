"""The agent's main loop: connect (with backoff, over a list of servers), say Hello with what it
still runs, heartbeat, run what it is assigned, report, reconnect.

Reports that matter survive a lost stream: the end of an attempt is re-sent on every reconnect until
a server acknowledges it, and a Hello names every attempt the agent still holds with its phase, so the
server can catch up on anything lost with the old stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

import grpc

from podium import __version__
from podium.agent import materialize
from podium.agent.backends.base import (
    FAILURE_CANCELLED,
    FAILURE_EXIT,
    FAILURE_INTERNAL,
    FAILURE_OOM,
    FAILURE_PROVISIONING,
    Backend,
    Fingerprint,
    Handle,
    RegistryAuth,
    ReleaseProof,
    RunSpec,
    StartFailed,
)
from podium.agent.backends.process import ProcessBackend
from podium.agent.fence import LEASE_EXPIRED, FenceKeeper
from podium.agent.workdirs import WorkDirs
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.protocol import FINAL_KINDS, PROTOCOL_MAX, PROTOCOL_MIN, fence_after, take_batch
from podium.security.masking import Masker
from podium.security.secretbox import write_private
from podium.timing import Timing
from podium.wakeups import drain_wakeups

log = logging.getLogger(__name__)

K = pb.TaskEvent.Kind
_FINAL = frozenset(K.Value(name) for name in FINAL_KINDS)  # the reports kept until acknowledged
MAX_BUFFERED = 100_000  # messages kept while no server is reachable; the oldest logs go first
MAX_UNACKED_LOG_BYTES = 64 * 2**20  # per attempt: output kept until a server has stored it
BACKOFF_MIN = 0.2
BACKOFF_MAX = 10.0
FINGERPRINT_EVERY = 10.0  # seconds at most between two looks at whether each backend still works
FINGERPRINT_MIN = 1.0  # seconds at least between them, however fast the heartbeat
FINGERPRINT_TIMEOUT = 10.0  # seconds a backend has to say whether it works (or list what it left)
PROOF_RESEND_FOR = 600.0  # seconds a release proof is sent again on each new stream (repeats change nothing)
MAX_PROOFS = 10_000  # release proofs kept for sending again, the oldest go first
# the classes a node may report for an end; a stop's class (cancelled, timeout) is the server's to name
_REPORTED_CLASSES = frozenset({FAILURE_EXIT, FAILURE_OOM, FAILURE_PROVISIONING, FAILURE_INTERNAL})
SIGKILL_EXIT = 128 + signal.SIGKILL  # a process (or container) that died of SIGKILL, as a shell reports it
# Seconds an attempt's `running` waits for its end, to go in the same write: the server then records
# both in one change and one commit (`Change.via`), where a `running` sent alone is committed on its
# own and the end waits for that commit. A short command (a `true`, a `date`) ends well within it;
# a longer one's `running` is this much later, or sent with its first output, whichever comes first.
RUNNING_HOLD = 0.005


@dataclass
class AgentConfig:
    servers: list[str]
    state_dir: Path
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    cpu_millis: int = 1000
    memory_bytes: int = 2**30
    disk_bytes: int = 0
    slots: int = 4
    pool: str = "default"
    arch: str = "x86_64"
    capabilities: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    gpu_indexes: list[int] = field(default_factory=list)
    credential: str = ""  # a join token; once enrolled, the node credential in state_dir wins
    ca_file: Path | None = None  # verify the server with this CA (implies TLS)
    tls: bool = False  # TLS with the system's CAs
    client_cert: Path | None = None  # mutual TLS
    client_key: Path | None = None
    journal: Path | None = None  # ground truth: what this agent actually started and stopped
    drop_assigns: bool = False  # for fault tests: a node that never accepts
    provision_delay: float = 0.0  # for fault tests: a provisioning step that takes this long
    answer_delay: float = 0.0  # for fault tests: a node this slow to say "provisioning" to an Assign
    backends: list[str] = field(default_factory=lambda: ["process"])  # "process", "container"
    container_host: str | None = None  # the engine's URL; None: DOCKER_HOST, else the default socket
    # how many provisioning operations (pulls, creates) this node runs at once (seed Capacity.Operations)
    max_operations: int | None = None  # None: as many as it has slots (no limit beyond them)


@dataclass(eq=False)
class Attempt:
    task_id: str
    token: int
    attempt: int
    spec: dict
    phase: str = "provisioning"
    backend: Backend | None = None
    handle: Handle | None = None  # set once the sandbox started: what stop and destroy act on
    final: pb.TaskEvent | None = None  # kept until a server acknowledges it
    # the next chunk's seq (over both streams: the order output was read here) and each stream's next byte offset
    seq: int = 0
    offset: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    cancel_requested: bool = False
    runner: asyncio.Task | None = None
    # set when the server has recorded "provisioning" (or the attempt is cancelled): before that, the
    # accept deadline may still give the task to another node, so nothing may start
    go: asyncio.Event = field(default_factory=asyncio.Event)
    # output not yet stored by a server, oldest first: sent again on the next stream if this one dies
    unacked: deque[pb.LogChunk] = field(default_factory=deque)
    unacked_bytes: int = 0
    masker: Masker = field(default_factory=lambda: Masker([]))
    # when the Assign arrived (monotonic): a lapse of the lease after it may have given it away
    assigned_at: float = field(default_factory=time.monotonic)
    # set when this agent itself stops the attempt (superseded, shut down): why, in the node's words
    stopped_by: str | None = None
    # the attempt's `running`, held for RUNNING_HOLD to go with its end, and the timer that sends it
    held_running: pb.TaskEvent | None = None
    running_timer: asyncio.TimerHandle | None = None


class NodeRemoved(Exception):
    """The server refused this node for good (removed, or its credential is not accepted)."""


class Superseded(Exception):
    """Another agent process now presents this node's identity. This one has killed its attempts and
    must exit without reconnecting: two copies reconnecting would knock each other off for ever."""

    def __init__(self, reason: str, by: str) -> None:
        super().__init__(f"{reason}: superseded by instance {by}")
        self.reason = reason
        self.by = by


# A server that refuses *who this agent is* (not a server that is down): retrying cannot help, the
# operator must act, so the agent exits with the server's reason.
_REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)


def new_instance_id() -> str:
    """Names this agent process among every one that ever presented the node's identity: where it
    runs and its pid, for the operator reading the node's history, and a random part, for uniqueness."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class Agent:
    def __init__(self, config: AgentConfig, node_id: str, timing: Timing) -> None:
        self.cfg = config
        self.node_id = node_id
        self.instance_id = new_instance_id()
        self.timing = timing
        self.heartbeat_seconds = timing.heartbeat
        self.kill_grace = timing.kill_grace
        self.attempts: dict[int, Attempt] = {}
        self._outq: asyncio.Queue[pb.AgentMessage] | None = None  # the live stream's queue
        self._buffer: deque[pb.AgentMessage] = deque()  # what waits for a stream
        self.connected = asyncio.Event()
        self.workdir = config.state_dir / "tasks"
        self.workdirs = WorkDirs(self.workdir)
        self.fence_after = fence_after(timing)  # until a Welcome says otherwise
        self._beats_sent: dict[int, float] = {}  # heartbeat seq → when it was sent (monotonic)
        self.backends: dict[str, Backend] = {}
        for kind in dict.fromkeys(config.backends or ["process"]):
            if kind == "process":
                self.backends[kind] = ProcessBackend()
            elif kind == "container":
                # imported only when asked for: a process-only agent never loads an engine client
                from podium.agent.backends.container import ContainerBackend

                self.backends[kind] = ContainerBackend(node_id, self.instance_id, config.container_host)
            else:
                raise ValueError(f"unknown backend {kind!r}: use process or container")
        engine = getattr(self.backends.get("container"), "engine_url", None)
        self.fence = FenceKeeper(config.journal, engine=engine, node=node_id)
        # what each backend said the last time it was asked; the Hello offers only the available ones
        self.fingerprints: dict[str, Fingerprint] = {}
        self._rehello = asyncio.Event()  # the backends on offer changed: say Hello again
        self._look_again = asyncio.Event()  # fingerprint now (an image was just pulled)
        self._proofs: deque[tuple[float, pb.ReleaseProof]] = deque(maxlen=MAX_PROOFS)
        # the backends whose leftovers from earlier instances were listed (and removed): once each,
        # at start or, for a backend that did not answer then, when it first does
        self._recovered: set[str] = set()

    # ---- ground truth ------------------------------------------------------------------------

    def _journal(self, **entry: object) -> None:
        if self.cfg.journal is None:
            return
        entry["t"] = time.time()
        entry["node"] = self.node_id
        with open(self.cfg.journal, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

    # ---- sending ------------------------------------------------------------------------------

    def _send(self, msg: pb.AgentMessage) -> None:
        if self._outq is not None:
            self._outq.put_nowait(msg)
            return
        self._buffer.append(msg)
        while len(self._buffer) > MAX_BUFFERED:
            self._buffer.popleft()

    def _event(
        self, a: Attempt, kind: pb.TaskEvent.Kind, exit_code: int = 0, message: str = "", failure_class: str = "", backend_ref: str = ""
    ) -> None:
        ev = pb.TaskEvent(task_id=a.task_id, fencing_token=a.token, kind=kind, exit_code=exit_code, message=message,
                          failure_class=failure_class, backend_ref=backend_ref)  # fmt: skip
        if kind == K.RUNNING:
            a.held_running = ev
            a.running_timer = asyncio.get_running_loop().call_later(RUNNING_HOLD, self._send_running, a)
            return
        self._send_running(a)  # a `running` still held goes first, in the same write
        if kind in _FINAL:
            a.final = ev
            a.phase = "exited"
        self._send(pb.AgentMessage(event=ev))

    def _send_running(self, a: Attempt) -> None:
        """Send the attempt's held `running` now (nothing if none is held)."""
        if a.held_running is None:
            return
        if a.running_timer is not None:
            a.running_timer.cancel()
            a.running_timer = None
        ev, a.held_running = a.held_running, None
        self._send(pb.AgentMessage(event=ev))

    # ---- connection -----------------------------------------------------------------------------

    async def run(self) -> None:
        await self._fingerprint()
        await self._recover()
        watcher = asyncio.get_running_loop().create_task(self._watch_backends(), name="agent.backends")
        try:
            await self._connect_loop()
        finally:
            watcher.cancel()

    async def _connect_loop(self) -> None:
        backoff = BACKOFF_MIN
        i = 0
        while True:
            server = self.cfg.servers[i % len(self.cfg.servers)]
            started = time.monotonic()
            try:
                await self._session_until_rehello(server)
            except grpc.aio.AioRpcError as e:
                if e.code() in _REFUSED:
                    log.error("server %s refused this node: %s", server, e.details())
                    raise NodeRemoved(e.details() or e.code().name) from None
                else:
                    log.warning("stream to %s ended: %s %s", server, e.code().name, e.details())
            except (TimeoutError, OSError) as e:
                log.warning("stream to %s failed: %s", server, e)
            finally:
                self._outq = None
                self.connected.clear()
            if time.monotonic() - started > 5:
                backoff = BACKOFF_MIN  # it was a working session: reconnect quickly
            i += 1
            delay = backoff * (0.5 + random.random())
            log.info("reconnecting in %.1fs", delay)
            await asyncio.sleep(delay)
            # never longer than a heartbeat: a node whose server comes back must be heard from
            # again well inside its offline window, or its work is given away while it could report
            backoff = min(BACKOFF_MAX, self.heartbeat_seconds, backoff * 2)

    async def _session_until_rehello(self, server: str) -> None:
        """One session, ended early when the backends on offer changed: the server learns a node's
        backends, egress contexts and limits from its Hello, so a new Hello is how it is told."""
        self._rehello.clear()
        session = asyncio.get_running_loop().create_task(self._session(server), name="agent.session")
        changed = asyncio.get_running_loop().create_task(self._rehello.wait())
        try:
            await asyncio.wait({session, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            if not session.done():
                session.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await session
        if session.cancelled():
            raise OSError("the backends this node offers changed; saying Hello again")
        session.result()

    # ---- backends -------------------------------------------------------------------------------

    async def _fingerprint(self) -> tuple[bool, bool]:
        """Ask every backend whether it works now. Returns (availability changed, artifacts changed)."""
        before = self.fingerprints
        after: dict[str, Fingerprint] = {}
        for kind, backend in self.backends.items():
            try:
                async with asyncio.timeout(FINGERPRINT_TIMEOUT):  # (not wait_for: see _read_stream)
                    after[kind] = await backend.fingerprint()
            except TimeoutError:
                after[kind] = Fingerprint(kind=kind, available=False, detail=f"no answer within {FINGERPRINT_TIMEOUT:g}s")
            except Exception as e:  # a backend that cannot say is not available
                after[kind] = Fingerprint(kind=kind, available=False, detail=str(e))
            if before.get(kind) is None or before[kind].available != after[kind].available:
                log.log(logging.INFO if after[kind].available else logging.WARNING,
                        "backend %s: %s (%s)", kind, "available" if after[kind].available else "unavailable",
                        after[kind].detail)  # fmt: skip
        self.fingerprints = after

        def offered(fps: dict[str, Fingerprint]) -> tuple[object, ...]:
            live = [fp for fp in fps.values() if fp.available]
            return (sorted(fp.kind for fp in live), sorted({e for fp in live for e in fp.egress}),
                    any(fp.enforces_limits for fp in live), materialize.runtimes(fps))  # fmt: skip

        return bool(before) and offered(before) != offered(after), self._artifacts(before) != self._artifacts(after)

    def _artifacts(self, fps: dict[str, Fingerprint] | None = None) -> list[str]:
        """The artifacts this node holds: those it was told of, and the image digests its engine has."""
        held = {d for fp in (self.fingerprints if fps is None else fps).values() if fp.available for d in fp.artifacts}
        return list(dict.fromkeys([*self.cfg.artifacts, *sorted(held)]))

    async def _watch_backends(self) -> None:
        """Look again every heartbeat (within FINGERPRINT_MIN..FINGERPRINT_EVERY) or after a pull: a
        backend that came or went is told with a new Hello, a changed set of images with an Inventory."""
        while True:
            every = min(FINGERPRINT_EVERY, max(FINGERPRINT_MIN, self.heartbeat_seconds))
            with contextlib.suppress(TimeoutError):
                # not wait_for, which in Python 3.11 loses a cancel that comes as the wait ends
                async with asyncio.timeout(every):
                    await self._look_again.wait()
            self._look_again.clear()
            try:
                availability, artifacts = await self._fingerprint()
                # a backend that did not answer at start (an engine slow to come up, or busy) has
                # had nothing of an earlier instance removed yet: now that it answers, before it is
                # offered again
                await self._recover()
            except Exception:  # never let one bad look end the looking
                log.exception("fingerprinting the backends failed")
                continue
            if availability:
                self._rehello.set()
            elif artifacts and self._outq is not None:
                self._send(pb.AgentMessage(inventory=pb.Inventory(artifacts=self._artifacts())))

    async def _recover(self) -> None:
        """Sandboxes an earlier instance of this agent left (it was killed, the machine rebooted):
        each is removed and its removal proved, so the capacity its attempt holds is freed. None is
        re-attached: the server learns from this agent's Hello that it no longer holds those
        attempts and applies the node-loss policy (docs/decisions.md)."""
        for kind, backend in self.backends.items():
            if kind in self._recovered or not self.fingerprints.get(kind, Fingerprint(kind, False)).available:
                continue
            try:
                async with asyncio.timeout(FINGERPRINT_TIMEOUT):
                    found = await backend.recover()
            except Exception as e:  # listed again at the next look at the backends
                log.warning("backend %s: cannot list what an earlier agent left (%s)", kind, e)
                continue
            self._recovered.add(kind)
            for r in found:
                if r.instance == self.instance_id:
                    continue
                log.warning("removing the %s %s of task %s (token %d) left by an earlier agent (%s)",
                            kind, r.handle.ref[:12], r.handle.task_id, r.handle.token,
                            "still running" if r.running else f"exited {r.exit_code}")  # fmt: skip
                try:
                    proof = await backend.destroy(r.handle)
                except Exception as e:
                    log.warning("cannot remove the %s %s: %s", kind, r.handle.ref[:12], e)
                    continue
                self._journal(ev="removed", task=r.handle.task_id, token=r.handle.token, ref=proof.ref, recovered=True)
                self._prove(r.handle.task_id, r.handle.token, proof)

    def _prove(self, task_id: str, token: int, proof: ReleaseProof) -> None:
        msg = pb.ReleaseProof(task_id=task_id, fencing_token=token, backend_ref=proof.ref,
                              released_at=proof.at.timestamp())  # fmt: skip
        # kept to be sent again on each new stream for a while: the protocol has no ack for a proof,
        # and one lost with a stream would leave its capacity releasing until the node is lost
        self._proofs.append((time.monotonic(), msg))
        self._send(pb.AgentMessage(released=msg))

    def _proofs_to_resend(self) -> list[pb.ReleaseProof]:
        cutoff = time.monotonic() - PROOF_RESEND_FOR
        while self._proofs and self._proofs[0][0] < cutoff:
            self._proofs.popleft()
        return [p for _, p in self._proofs]

    @property
    def _credential_path(self) -> Path:
        return self.cfg.state_dir / "credential"

    def _credential(self) -> str:
        if self._credential_path.exists():
            return self._credential_path.read_text().strip()
        return self.cfg.credential

    def _channel(self, server: str) -> grpc.aio.Channel:
        drain_wakeups()  # a busy agent's loop hears every finished read and write in one turn
        c = self.cfg
        if not (c.tls or c.ca_file):
            return grpc.aio.insecure_channel(server)
        creds = grpc.ssl_channel_credentials(
            root_certificates=c.ca_file.read_bytes() if c.ca_file else None,
            private_key=c.client_key.read_bytes() if c.client_key else None,
            certificate_chain=c.client_cert.read_bytes() if c.client_cert else None,
        )
        return grpc.aio.secure_channel(server, creds)

    def _hello(self) -> pb.AgentMessage:
        c = self.cfg
        return pb.AgentMessage(hello=pb.Hello(
            node_id=self.node_id, name=c.name, credential=self._credential(), labels=c.labels,
            capacity=pb.Resources(cpu_millis=c.cpu_millis, memory_bytes=c.memory_bytes, disk_bytes=c.disk_bytes,
                                  gpus=len(c.gpu_indexes), slots=c.slots),
            backends=[k for k, fp in self.fingerprints.items() if fp.available] if self.fingerprints
            else [k for k in self.backends if k == "process"], pool=c.pool, arch=c.arch,
            capabilities=c.capabilities, artifacts=self._artifacts(),
            egress_contexts=sorted({e for fp in self.fingerprints.values() if fp.available for e in fp.egress}),
            enforces_limits=any(fp.available and fp.enforces_limits for fp in self.fingerprints.values()),
            protocol_min=PROTOCOL_MIN, protocol_max=PROTOCOL_MAX, gpu_indexes=c.gpu_indexes, agent_version=__version__,
            instance_id=self.instance_id, max_operations=c.max_operations or c.slots,
            materializations=materialize.snapshots(self.fingerprints, c.arch),
            tasks=[pb.RunningTask(task_id=a.task_id, fencing_token=a.token, phase=a.phase)
                   for a in self.attempts.values()], batches=True,
        ))  # fmt: skip

    async def _session(self, server: str) -> None:
        outq: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()
        # The stream is written by a task of our own (call.write), not fed by an async generator:
        # on a reconnect every piece is then cancelled and awaited here, and nothing is left for
        # the garbage collector to finalise mid-read (asyncio's "Task was destroyed but it is
        # pending", "aclose(): asynchronous generator is already running").
        writer: asyncio.Task | None = None
        beat: asyncio.Task | None = None
        async with self._channel(server) as channel:
            stub = pb_grpc.AgentGatewayStub(channel)
            hello_sent = time.monotonic()
            call = stub.Connect()
            try:
                await call.write(self._hello())
                async with asyncio.timeout(30):
                    first = await call.read()
                if first is not grpc.aio.EOF and first.HasField("superseded"):
                    self._superseded(first.superseded)
                if first is grpc.aio.EOF or not first.HasField("welcome"):
                    raise OSError("the server did not answer the Hello with a Welcome")
                w = first.welcome
                self.heartbeat_seconds = w.heartbeat_seconds or self.heartbeat_seconds
                self.kill_grace = w.kill_grace_seconds or self.kill_grace
                self.fence_after = w.fence_after_seconds or self.fence_after
                if w.node_credential:
                    # enrolled now: from here on this node proves itself with its own credential
                    self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
                    write_private(self._credential_path, (w.node_credential + "\n").encode())
                    log.info("enrolled as %s; credential kept in %s", self.node_id, self._credential_path)
                # the Hello was recorded as a heartbeat: the lease runs from when it was sent
                self.fence.renew(hello_sent + self.fence_after)
                log.info("connected to %s (server %s) as %s, instance %s", server, w.server_id, self.node_id, self.instance_id)
                # What is owed from before: output no server has stored, then unacknowledged ends (the
                # server stores an attempt's output before its end), then whatever waited for a stream.
                for a in list(self.attempts.values()):
                    for chunk in a.unacked:
                        outq.put_nowait(pb.AgentMessage(log=chunk))
                for a in list(self.attempts.values()):
                    if a.final is not None:
                        outq.put_nowait(pb.AgentMessage(event=a.final))
                for proof in self._proofs_to_resend():
                    outq.put_nowait(pb.AgentMessage(released=proof))
                while self._buffer:
                    msg = self._buffer.popleft()
                    if msg.HasField("event") and msg.event.kind in _FINAL:
                        continue  # already re-sent above from the attempt itself
                    if msg.HasField("log") or msg.HasField("released"):
                        continue  # re-sent above from the attempt's unacknowledged output, or the proofs kept
                    outq.put_nowait(msg)
                self._outq = outq
                self.connected.set()
                writer = asyncio.get_running_loop().create_task(self._write(call, outq, w.batches), name="agent.write")
                beat = asyncio.get_running_loop().create_task(self._heartbeats(outq), name="agent.heartbeat")
                # A healthy server acks a heartbeat at least every quarter of the lease; one silent
                # for half of it is stuck (paused, partitioned): try the next server.
                await _read_stream(call, self.fence_after / 2, self._on_message)
            finally:
                self._outq = None
                pending = [t for t in (beat, writer) if t is not None]
                for t in pending:
                    t.cancel()
                call.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                # keep what was not handed to the transport for the next stream
                while not outq.empty():
                    self._buffer.append(outq.get_nowait())

    async def _write(self, call: grpc.aio.StreamStreamCall, outq: asyncio.Queue[pb.AgentMessage], batches: bool = False) -> None:
        """Hand the stream's messages to gRPC in order. To a server that takes batches (its Welcome
        said so), everything queued at the moment of a write goes in that one write: the reports of
        the attempts that changed in one loop turn, an end with the output before it. A failed write
        ends the stream's writing; the reader sees the stream end and the session reconnects."""
        carry: pb.AgentMessage | None = None
        try:
            while True:
                msg, carry = (carry, None) if carry is not None else (await outq.get(), None)
                out = msg
                if batches:
                    batch, carry, _ended = take_batch(outq, msg, pb.AgentMessage.ByteSize)  # type: ignore[arg-type]
                    out = batch[0] if len(batch) == 1 else pb.AgentMessage(batch=pb.AgentBatch(messages=batch))
                try:
                    await call.write(out)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                    log.debug("stream write failed: %s", e)
                    return
        finally:
            # taken from the queue but not written: it waits for the next stream ahead of what is
            # still queued (the session moves that to the buffer after this task has ended)
            if carry is not None:
                self._buffer.append(carry)

    def _superseded(self, note: pb.Superseded) -> None:
        """Another process presents this node's identity now: stop every attempt at once (the server
        gives them away only after this instance's fence deadline, which must then be moot), and leave."""
        log.error("%s (instance %s); this instance %s stops its attempts and exits", note.reason, note.instance_id, self.instance_id)
        for a in self.attempts.values():
            if a.final is None:
                a.stopped_by = f"stopped on this node: this agent instance was superseded by instance {note.instance_id or 'unknown'}"
        # Every process group still fenced is killed from here at once (a group whose attempt has
        # ended is no longer fenced: its number may be another process's by now), and the keeper
        # kills the same groups and every container (through the engine).
        self.fence.fence_now("superseded")
        raise Superseded(note.reason or "superseded", note.instance_id or "unknown")

    async def _heartbeats(self, outq: asyncio.Queue[pb.AgentMessage]) -> None:
        seq = 0
        while True:
            seq += 1
            self._beats_sent[seq] = time.monotonic()
            outq.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq, running=len(self.attempts))))
            await asyncio.sleep(self.heartbeat_seconds)

    def _on_message(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "batch":
            # in the order the server wrote them, exactly as if each had come on its own
            for m in msg.batch.messages:
                if m.WhichOneof("kind") in ("batch", "welcome"):
                    log.warning("the server sent a %s inside a batch; ignored", m.WhichOneof("kind"))
                    continue
                self._on_message(m)
        elif kind == "assign":
            self._on_assign(msg.assign)
        elif kind == "cancel":
            self._on_cancel(msg.cancel)
        elif kind == "ack":
            a = self.attempts.get(msg.ack.fencing_token)
            if a is not None and a.final is not None:
                del self.attempts[a.token]
        elif kind == "log_ack":
            ack = msg.log_ack
            a = self.attempts.get(ack.fencing_token)
            if a is not None and a.unacked:
                kept = deque(c for c in a.unacked if not (c.stream == ack.stream and c.seq <= ack.seq))
                if len(kept) != len(a.unacked):
                    a.unacked = kept
                    a.unacked_bytes = sum(len(c.data) for c in kept)
        elif kind == "accepted":
            a = self.attempts.get(msg.accepted.fencing_token)
            if a is not None:
                a.go.set()
        elif kind == "heartbeat_ack":
            sent = self._beats_sent.get(msg.heartbeat_ack.seq)
            if sent is not None:
                self.fence.renew(sent + self.fence_after)
                for seq in [q for q in self._beats_sent if q <= msg.heartbeat_ack.seq]:
                    del self._beats_sent[seq]
        elif kind == "drain":
            log.info("server says draining=%s", msg.drain.draining)
        elif kind == "superseded":
            self._superseded(msg.superseded)

    # ---- running tasks -------------------------------------------------------------------------

    def _on_assign(self, asg: pb.Assign) -> None:
        if self.cfg.drop_assigns:
            log.warning("dropping Assign for %s (configured never to accept)", asg.task_id)
            return
        if asg.fencing_token in self.attempts:
            return  # a redelivery of what is already running
        a = Attempt(asg.task_id, asg.fencing_token, asg.attempt, json.loads(asg.spec_json))
        a.masker = Masker([s.value for s in asg.secrets] + [r.password for r in asg.registries])
        self.attempts[a.token] = a
        env = {s.env: s.value for s in asg.secrets}
        # held in memory for this attempt only: never logged, never written to the node's disk
        logins = [RegistryAuth(r.registry, r.username, r.password) for r in asg.registries]
        # Accepted, the start's go-ahead, waits for this: queued in the turn that read the Assign, not
        # in the next one, when the attempt's task first runs
        if self.cfg.answer_delay > 0:
            asyncio.get_running_loop().call_later(self.cfg.answer_delay, self._answer_late, a)
        else:
            self._event(a, K.PROVISIONING)
        a.runner = asyncio.get_running_loop().create_task(
            self._run(a, env, list(asg.gpu_indexes), logins), name=f"agent.task.{a.task_id}"
        )

    def _answer_late(self, a: Attempt) -> None:
        """The `provisioning` a slow node (`answer_delay`) sends at last, unless the attempt ended or
        was cancelled meanwhile: nothing of an attempt is reported after its end."""
        if self.attempts.get(a.token) is a and a.final is None and not a.cancel_requested:
            self._event(a, K.PROVISIONING)

    def _on_cancel(self, c: pb.Cancel) -> None:
        a = self.attempts.get(c.fencing_token)
        if a is None:
            # never received (or long forgotten): say so, so the server need not wait out CancelGrace
            self._send(pb.AgentMessage(event=pb.TaskEvent(
                task_id=c.task_id, fencing_token=c.fencing_token, kind=K.NOT_RUNNING, message="no such attempt here")))  # fmt: skip
            return
        if a.final is not None:
            self._send(pb.AgentMessage(event=a.final))
            return
        a.cancel_requested = True
        a.go.set()
        if a.backend is not None and a.handle is not None:
            asyncio.get_running_loop().create_task(
                a.backend.stop(a.handle, self.kill_grace, FAILURE_CANCELLED), name=f"agent.stop.{a.task_id}"
            )

    def _run_spec(
        self, a: Attempt, backend: Backend, secret_env: dict[str, str], gpus: list[int], logins: list[RegistryAuth], workdir: Path
    ) -> tuple[RunSpec, dict[str, str]]:
        """The task's spec in its backend's terms, and the environment it runs with."""
        ids = {"PODIUM_TASK_ID": a.task_id, "PODIUM_ATTEMPT": str(a.attempt), "PODIUM_NODE_ID": self.node_id}
        return backend.run_spec(RunSpec(a.task_id, a.token, a.attempt), a.spec, ids, secret_env, gpus, logins, workdir)

    async def _run(self, a: Attempt, secret_env: dict[str, str], gpus: list[int], logins: list[RegistryAuth] | None = None) -> None:
        """An attempt whose `provisioning` is already sent: prepared, started once Accepted, waited for."""
        kind = a.spec.get("backend") or "process"
        backend = self.backends.get(kind)
        workdir = self.workdir / f"{a.task_id}-{a.token}"
        handle: Handle | None = None
        run_spec: RunSpec | None = None
        try:
            if backend is None or not self.fingerprints.get(kind, Fingerprint(kind, kind == "process")).available:
                # placed here on an offer this node no longer makes: another node may do it
                self._event(a, K.FAILED_RETRYABLE, message=f"this node cannot run {kind} tasks now",
                            failure_class=FAILURE_PROVISIONING)  # fmt: skip
                return
            a.backend = backend
            if backend.uses_workdir:
                self.workdirs.make(workdir.name)  # before Accepted: nothing of it between that and the start
            run_spec, env = self._run_spec(a, backend, secret_env, gpus, logins or [], workdir)
            if self.cfg.provision_delay:
                await asyncio.sleep(self.cfg.provision_delay)
            try:
                await backend.prepare(run_spec, env, workdir)  # the pull and the create, before Accepted
                if backend.holds_artifacts:
                    self._look_again.set()  # an image may have arrived: tell the server what is held
                # Start only once the server has recorded that this node accepted: an assignment revoked
                # by the accept deadline (its "provisioning" came too late) is then never started here.
                await a.go.wait()
                if a.cancel_requested:
                    self._event(a, K.EXITED, exit_code=130, message="cancelled before it started")
                    return
                if a.stopped_by is not None or self.fence.lapsed_since(a.assigned_at):
                    # This node's lease ran out after the Assign came (or the agent is going): the
                    # server may have given the task to another node, and the fence keeper would kill
                    # the process at once anyway. Never started; another node may run it.
                    refused = a.stopped_by or (f"not started on this node: no heartbeat acknowledged for "
                                               f"{self.fence_after:g}s after it was assigned")  # fmt: skip
                    log.warning("task %s (token %d): %s", a.task_id, a.token, refused)
                    self._event(a, K.FAILED_RETRYABLE, message=refused)
                    return
                handle = await backend.start(run_spec, env, workdir)
            except StartFailed as e:
                if e.exit_code is not None:
                    # the command is not there on this node: the exit a shell would give
                    await self._output(a, "stderr", (e.message + "\n").encode())
                    self._event(a, K.EXITED, exit_code=e.exit_code, message=e.message)
                else:
                    # the sandbox could not be made here (a pull, a create): another node may do better
                    self._event(a, K.FAILED_RETRYABLE, message=e.message, failure_class=e.failure_class)
                return
            a.handle = handle
            a.phase = "running"
            try:
                fenced_as = backend.fence(self.fence, handle, a.task_id, a.token)
                self._journal(ev="start", task=a.task_id, token=a.token, **fenced_as)
                self._event(a, K.RUNNING, backend_ref=handle.ref)
                if a.cancel_requested:
                    asyncio.get_running_loop().create_task(backend.stop(handle, self.kill_grace, FAILURE_CANCELLED))
                result = await backend.wait(handle, lambda stream, data: self._output(a, stream, data))
                for stream in ("stdout", "stderr"):
                    await self._emit(a, stream, a.masker.flush(stream))
                # The process is dead: if the fence keeper killed it, its word is already written.
                fenced = self.fence.killed(a.token)
            finally:
                # however the wait ended: a group left registered could be killed at the next lapse
                # under a number another process has by then
                backend.unfence(self.fence, handle)
            self._journal(ev="stop", task=a.task_id, token=a.token, code=result.exit_code)
            # Who ended it, as known rather than guessed: this agent (superseded, shutting down), or the
            # fence keeper whose SIGKILL it died of. Neither is the task's own exit.
            why = a.stopped_by
            if why is None and fenced is not None and result.exit_code == SIGKILL_EXIT:
                why = (f"stopped on this node: no heartbeat acknowledged for {self.fence_after:g}s" if fenced == LEASE_EXPIRED
                       else f"stopped on this node by its fence keeper: {fenced}")  # fmt: skip
            if why is not None and not a.cancel_requested:
                # another node may run it: this one stopped it for its own reasons, not the task's
                log.warning("task %s (token %d): %s (exit %s)", a.task_id, a.token, why, result.exit_code)
                self._event(a, K.FAILED_RETRYABLE, message=why)
            elif result.exit_code is None:
                self._event(a, K.FAILED_RETRYABLE, message=result.message, failure_class=FAILURE_INTERNAL)
            else:
                cls = result.failure_class if result.failure_class in _REPORTED_CLASSES else ""
                self._event(a, K.EXITED, exit_code=result.exit_code, message=result.message, failure_class=cls)
        except asyncio.CancelledError:
            if backend is not None and handle is not None:
                await backend.stop(handle, 0, FAILURE_INTERNAL)
            raise
        except Exception as e:  # an agent-side failure: another node may do better
            log.exception("task %s failed on this node", a.task_id)
            if backend is not None and handle is not None:
                # no longer fenced: it must not run on behind the report that it ended
                with contextlib.suppress(Exception):
                    await backend.stop(handle, 0, FAILURE_INTERNAL)
            self._event(a, K.FAILED_RETRYABLE, message=str(e))
        finally:
            # kept for the next attempt if it is empty, else removed in a worker thread (agent/workdirs.py);
            # the end is already queued: its report goes out meanwhile
            await self.workdirs.release(workdir)
            if backend is not None and backend.proves_release:
                await self._release(a, backend, handle, run_spec)

    async def _release(self, a: Attempt, backend: Backend, handle: Handle | None, spec: RunSpec | None) -> None:
        """Remove a container attempt's sandbox and prove it gone: only the proof frees its capacity.
        Never started: what provisioning made (if anything) is discarded (a failed pull or create
        leaves no container behind)."""
        try:
            if handle is not None:
                proof = await backend.destroy(handle)
            elif spec is not None:
                proof = await backend.discard(spec)
            else:
                proof = ReleaseProof("", datetime.now(UTC))
        except Exception as e:  # no proof: the capacity stays held; a restarted agent removes it
            log.warning("task %s: cannot remove its container (%s); its capacity stays held", a.task_id, e)
            return
        if proof.ref:
            self._journal(ev="removed", task=a.task_id, token=a.token, ref=proof.ref)
        self._prove(a.task_id, a.token, proof)

    async def _output(self, a: Attempt, stream: str, data: bytes) -> None:
        # no secret value this task received leaves the node in its logs, whole or split
        await self._emit(a, stream, a.masker.feed(stream, data))

    async def _emit(self, a: Attempt, stream: str, data: bytes) -> None:
        if not data:
            return
        # Numbered here, synchronously, in the order the pumps handed output over: the order a reader
        # sees, whatever order chunks reach or are stored by a server.
        seq, offset = a.seq, a.offset[stream]
        a.seq = seq + 1
        a.offset[stream] = offset + len(data)
        chunk = pb.LogChunk(task_id=a.task_id, fencing_token=a.token, stream=stream, seq=seq, offset=offset, data=data)
        self._send_running(a)  # the server hears an attempt started before it hears its output
        a.unacked.append(chunk)
        a.unacked_bytes += len(data)
        while a.unacked_bytes > MAX_UNACKED_LOG_BYTES and a.unacked:
            a.unacked_bytes -= len(a.unacked.popleft().data)  # bounded: the oldest output goes first
        if self._outq is not None:
            self._outq.put_nowait(pb.AgentMessage(log=chunk))
        # with no stream, the chunk waits in `unacked` and is sent on the next one

    async def shutdown(self) -> None:
        """Stop every task (SIGTERM, then SIGKILL after the grace), let each runner report its end and
        remove its container, then stop the fence keeper and the backends."""
        for a in self.attempts.values():
            if a.final is None and a.stopped_by is None:
                a.stopped_by = "stopped on this node: its agent was shut down"
                a.go.set()  # one still waiting for Accepted ends now, never started
        await asyncio.gather(
            *(a.backend.stop(a.handle, self.kill_grace, FAILURE_CANCELLED) for a in self.attempts.values()
              if a.backend is not None and a.handle is not None),
            return_exceptions=True,
        )  # fmt: skip
        runners = [a.runner for a in self.attempts.values() if a.runner is not None and not a.runner.done()]
        if runners:
            await asyncio.wait(runners, timeout=self.kill_grace + 5)
        self.fence.close()
        for backend in self.backends.values():
            with contextlib.suppress(Exception):
                await backend.close()


async def _read_stream(call: grpc.aio.StreamStreamCall, silence: float, on_message: Callable[[pb.ServerMessage], None]) -> NoReturn:
    """Read the server's messages until the stream ends (OSError) or the server says nothing for
    `silence` seconds (OSError: a healthy server acks a heartbeat at least every quarter of the lease).

    One deadline, moved on at each message, not `asyncio.wait_for` per read: Python 3.11's wait_for
    returns the result of a read that ended in the same loop turn as a cancel of its caller, and the
    cancel is lost. A session cancelled for a new Hello (its backends changed) would read on until the
    stream ended, and the agent waiting for it with it. (It also made a task and a timer per message.)"""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(silence) as deadline:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise OSError("the server closed the stream")
                deadline.reschedule(loop.time() + silence)
                on_message(msg)
    except TimeoutError:
        raise OSError(f"the server said nothing for {silence:g}s") from None
