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
import shutil
import signal
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from podium import __version__
from podium.agent.fence import FenceKeeper
from podium.agent.process_backend import ProcessRun
from podium.security.masking import Masker
from podium.security.secretbox import write_private
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.timing import Timing

log = logging.getLogger(__name__)

K = pb.TaskEvent.Kind
MAX_BUFFERED = 100_000  # messages kept while no server is reachable; the oldest logs go first
MAX_UNACKED_LOG_BYTES = 64 * 2**20  # per attempt: output kept until a server has stored it
BACKOFF_MIN = 0.2
BACKOFF_MAX = 10.0


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


@dataclass(eq=False)
class Attempt:
    task_id: str
    token: int
    attempt: int
    spec: dict
    phase: str = "provisioning"
    run: ProcessRun | None = None
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
        self.fence = FenceKeeper(config.journal)
        self.fence_after = timing.offline_after - 2 * timing.heartbeat
        self._beats_sent: dict[int, float] = {}  # heartbeat seq → when it was sent (monotonic)

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

    def _event(self, a: Attempt, kind: int, exit_code: int = 0, message: str = "") -> None:
        ev = pb.TaskEvent(task_id=a.task_id, fencing_token=a.token, kind=kind, exit_code=exit_code, message=message)
        if kind in (K.EXITED, K.FAILED_RETRYABLE, K.NOT_RUNNING):
            a.final = ev
            a.phase = "exited"
        self._send(pb.AgentMessage(event=ev))

    # ---- connection -----------------------------------------------------------------------------

    async def run(self) -> None:
        backoff = BACKOFF_MIN
        i = 0
        while True:
            server = self.cfg.servers[i % len(self.cfg.servers)]
            started = time.monotonic()
            try:
                await self._session(server)
            except grpc.aio.AioRpcError as e:
                if e.code() in _REFUSED:
                    log.error("server %s refused this node: %s", server, e.details())
                    raise NodeRemoved(e.details() or e.code().name) from None
                else:
                    log.warning("stream to %s ended: %s %s", server, e.code().name, e.details())
            except (OSError, asyncio.TimeoutError) as e:
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
            backoff = min(BACKOFF_MAX, backoff * 2)

    @property
    def _credential_path(self) -> Path:
        return self.cfg.state_dir / "credential"

    def _credential(self) -> str:
        if self._credential_path.exists():
            return self._credential_path.read_text().strip()
        return self.cfg.credential

    def _channel(self, server: str) -> grpc.aio.Channel:
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
            backends=["process"], pool=c.pool, arch=c.arch, capabilities=c.capabilities, artifacts=c.artifacts,
            protocol_min=1, protocol_max=1, gpu_indexes=c.gpu_indexes, agent_version=__version__,
            instance_id=self.instance_id,
            tasks=[pb.RunningTask(task_id=a.task_id, fencing_token=a.token, phase=a.phase)
                   for a in self.attempts.values()],
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
                first = await asyncio.wait_for(call.read(), timeout=30)
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
                while self._buffer:
                    msg = self._buffer.popleft()
                    if msg.HasField("event") and msg.event.kind in (K.EXITED, K.FAILED_RETRYABLE, K.NOT_RUNNING):
                        continue  # already re-sent above from the attempt itself
                    if msg.HasField("log"):
                        continue  # re-sent above from the attempt's unacknowledged output
                    outq.put_nowait(msg)
                self._outq = outq
                self.connected.set()
                writer = asyncio.get_running_loop().create_task(self._write(call, outq), name="agent.write")
                beat = asyncio.get_running_loop().create_task(self._heartbeats(outq), name="agent.heartbeat")
                # A healthy server acks a heartbeat at least every quarter of the lease; one silent
                # for half of it is stuck (paused, partitioned): try the next server.
                silence = self.fence_after / 2
                while True:
                    try:
                        msg = await asyncio.wait_for(call.read(), timeout=silence)
                    except TimeoutError:
                        raise OSError(f"the server said nothing for {silence:g}s") from None
                    if msg is grpc.aio.EOF:
                        raise OSError("the server closed the stream")
                    self._on_message(msg)
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

    async def _write(self, call: grpc.aio.StreamStreamCall, outq: asyncio.Queue[pb.AgentMessage]) -> None:
        """Hand the stream's messages to gRPC in order. A failed write ends the stream's writing; the
        reader sees the stream end and the session reconnects."""
        while True:
            msg = await outq.get()
            try:
                await call.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                log.debug("stream write failed: %s", e)
                return

    def _superseded(self, note: pb.Superseded) -> None:
        """Another process presents this node's identity now: stop every attempt at once (the server
        gives them away only after this instance's fence deadline, which must then be moot), and leave."""
        log.error("%s (instance %s); this instance %s stops its attempts and exits", note.reason, note.instance_id, self.instance_id)
        for a in self.attempts.values():
            if a.run is not None and a.run.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(a.run.pid, signal.SIGKILL)
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
        if kind == "assign":
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
        a.runner = asyncio.get_running_loop().create_task(
            self._run(a, env, list(asg.gpu_indexes)), name=f"agent.task.{a.task_id}"
        )

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
        if a.run is not None:
            asyncio.get_running_loop().create_task(a.run.stop(self.kill_grace), name=f"agent.stop.{a.task_id}")

    async def _run(self, a: Attempt, secret_env: dict[str, str], gpus: list[int]) -> None:
        self._event(a, K.PROVISIONING)
        spec = a.spec
        workdir = self.workdir / f"{a.task_id}-{a.token}"
        env = dict(os.environ) if spec.get("inherit_env") else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update({"HOME": str(workdir), "PODIUM_TASK_ID": a.task_id, "PODIUM_ATTEMPT": str(a.attempt),
                    "PODIUM_NODE_ID": self.node_id})  # fmt: skip
        env.update(spec.get("env") or {})
        env.update(secret_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        run = ProcessRun(list(spec["command"]), env, workdir)
        try:
            if self.cfg.provision_delay:
                await asyncio.sleep(self.cfg.provision_delay)
            # Start only once the server has recorded that this node accepted: an assignment revoked
            # by the accept deadline (its "provisioning" came too late) is then never started here.
            await a.go.wait()
            if a.cancel_requested:
                self._event(a, K.EXITED, exit_code=130, message="cancelled before it started")
                return
            try:
                await run.start()
            except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
                # the command is not there: on this node; report it as the exit a shell would give
                msg = f"cannot start {spec['command'][0]!r}: {e.strerror}"
                await self._output(a, "stderr", (msg + "\n").encode())
                self._event(a, K.EXITED, exit_code=127 if isinstance(e, FileNotFoundError) else 126, message=msg)
                return
            a.run = run
            a.phase = "running"
            started = time.monotonic()
            assert run.pid is not None
            self.fence.add(run.pid, a.task_id, a.token)
            self._journal(ev="start", task=a.task_id, token=a.token, pid=run.pid)
            self._event(a, K.RUNNING)
            if a.cancel_requested:
                asyncio.get_running_loop().create_task(run.stop(self.kill_grace))
            code = await run.wait(lambda stream, data: self._output(a, stream, data))
            for stream in ("stdout", "stderr"):
                await self._emit(a, stream, a.masker.flush(stream))
            ended = time.monotonic()
            self.fence.remove(run.pid)
            self._journal(ev="stop", task=a.task_id, token=a.token, code=code)
            # A SIGKILL while the lease had run out is the fence keeper's, even when the acknowledgement
            # of a late heartbeat renewed the lease before this exit was seen: not the task's own exit.
            fenced = self.fence.expired(ended) or (code == 128 + 9 and self.fence.lapsed(started, ended))
            if fenced and not a.cancel_requested:
                # it was stopped here because this node lost its lease; another node may have it now
                msg = f"stopped on this node: no heartbeat acknowledged for {self.fence_after:g}s"
                self._event(a, K.FAILED_RETRYABLE, message=msg)
            else:
                self._event(a, K.EXITED, exit_code=code)
        except asyncio.CancelledError:
            await run.stop(0)
            raise
        except Exception as e:  # an agent-side failure: another node may do better
            log.exception("task %s failed on this node", a.task_id)
            self._event(a, K.FAILED_RETRYABLE, message=str(e))
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(workdir)

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
        a.unacked.append(chunk)
        a.unacked_bytes += len(data)
        while a.unacked_bytes > MAX_UNACKED_LOG_BYTES and a.unacked:
            a.unacked_bytes -= len(a.unacked.popleft().data)  # bounded: the oldest output goes first
        if self._outq is not None:
            self._outq.put_nowait(pb.AgentMessage(log=chunk))
        # with no stream, the chunk waits in `unacked` and is sent on the next one

    async def shutdown(self) -> None:
        """Stop every task (SIGTERM, then SIGKILL after the grace), then the fence keeper."""
        await asyncio.gather(
            *(a.run.stop(self.kill_grace) for a in self.attempts.values() if a.run is not None), return_exceptions=True
        )
        self.fence.close()
