"""A simulated fleet: one asyncio process holding N agent streams over the real gRPC protocol.

Every node speaks `podium.v1.AgentGateway.Connect` exactly as `podium.agent` does: a Hello with its
capacity, labels and the attempts it still holds; heartbeats every `Welcome.heartbeat_seconds` (and
tracks the HeartbeatAcks against `Welcome.fence_after_seconds`);
on Assign it reports PROVISIONING, RUNNING and, after `--duration-ms`, EXITED 0; a Cancel for an
attempt it does not hold is answered NOT_RUNNING, for one it runs EXITED 143, for one that already
ended with that end again; an Ack makes it forget the attempt; a lost stream is reconnected with
backoff and the unacknowledged ends are re-sent. Nothing is run: that is the only difference from a
real agent, and the server cannot see it.

What it measures: per task, the CLOCK_MONOTONIC time the first Assign arrived and the time the
server acknowledged its EXITED (the task is `succeeded` in the database by then). time.monotonic()
is system-wide on Linux, so these compare directly with the load generator's submit times.

Run as a subprocess of bench/run.py (or by hand):

    python bench/fleet.py --server 127.0.0.1:8643 --nodes 1000 --out /tmp/fleet.json

A server that enrols nodes needs PODIUM_JOIN_TOKEN in the environment; each node keeps the node
credential its first Welcome returns and presents it on reconnects, as a real agent does.

It prints one JSON status line per `--status-interval` on stdout. Commands on stdin, one per line:
`dump` (stop reconnecting, write the records to --out, print {"dumped": true}), `exit` (close every
stream and exit). EOF on stdin, SIGTERM or `--max-seconds` do both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from podium.heap import freeze_startup
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc
from podium.protocol import take_batch
from podium.wakeups import drain_wakeups

K = pb.TaskEvent.Kind
FINAL = (K.EXITED, K.FAILED_RETRYABLE, K.NOT_RUNNING)
BACKOFF_MIN = 0.2
BACKOFF_MAX = 10.0
WELCOME_TIMEOUT = 120.0
LAG_SAMPLE = 0.1  # seconds between looks at the fleet's own event-loop lag
AGENT_VERSION = "bench-fleet"


@dataclass(eq=False)
class Attempt:
    task_id: str
    token: int
    phase: str = "provisioning"
    final: pb.TaskEvent | None = None  # kept until a server acknowledges it
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class Node:
    idx: int
    node_id: str
    labels: dict[str, str]
    attempts: dict[int, Attempt] = field(default_factory=dict)
    outq: asyncio.Queue[pb.AgentMessage | None] | None = None
    buffer: list[pb.AgentMessage] = field(default_factory=list)  # what waits for a stream
    call: grpc.aio.StreamStreamCall | None = None
    connected: bool = False
    heartbeat_seconds: float = 10.0
    fence_after: float = 0.0  # from the Welcome; 0 when the server does not fence
    fence_until: float = 0.0  # monotonic: past it a real agent would stop its attempts itself
    beats_sent: dict[int, float] = field(default_factory=dict)  # heartbeat seq → sent (monotonic)
    sessions: int = 0
    credential: str = ""  # the node credential its first Welcome gave it (enrolment by join token)


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.duration = args.duration_ms / 1000.0
        self.stopping = asyncio.Event()
        self.exit = asyncio.Event()
        self.hello_gate = asyncio.Semaphore(args.connect_concurrency)
        # a new node enrols with the join token (from the environment, never the command line)
        self.join_token = os.environ.get("PODIUM_JOIN_TOKEN", "").strip()
        self.nodes = [
            Node(i, f"{args.prefix}-{i:05d}", {"bench": "1", "rack": f"r{i % 16}"}) for i in range(args.nodes)
        ]
        per = max(1, args.streams_per_channel)
        n_channels = (args.nodes + per - 1) // per
        # A local subchannel pool per channel: one TCP connection each, as separate agents would have.
        opts = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.keepalive_time_ms", 60000),
            ("grpc.max_receive_message_length", 64 * 2**20),
        ]
        drain_wakeups()  # as a real agent does: one turn of the fleet's loop hears every finished read and write
        self.channels = [grpc.aio.insecure_channel(args.server, options=opts + [("bench.channel", i)]) for i in range(n_channels)]
        self.stubs = [pb_grpc.AgentGatewayStub(c) for c in self.channels]
        # measurements
        self.assign_at: dict[str, float] = {}  # task id → first Assign receipt (monotonic)
        self.node_of: dict[str, int] = {}
        self.exited_ack_at: dict[str, float] = {}  # task id → Ack of its EXITED 0 (monotonic)
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.hello_latency: list[float] = []  # Hello sent → Welcome received, seconds
        self.beat_ack_latency: list[float] = []  # heartbeat sent → its HeartbeatAck, seconds
        self.first_welcome_at: float | None = None
        self.all_connected_at: float | None = None
        self.loop_lag: list[float] = []  # how late the fleet's own loop woke, seconds (a sample per 0.1 s)
        self.started_at = time.monotonic()
        self.connected = 0
        self.max_connected = 0

    # ---- one node -------------------------------------------------------------------------------

    def _send(self, n: Node, msg: pb.AgentMessage) -> None:
        if n.outq is not None:
            n.outq.put_nowait(msg)
        else:
            n.buffer.append(msg)

    def _event(self, n: Node, a: Attempt, kind: int, exit_code: int = 0, message: str = "") -> None:
        ev = pb.TaskEvent(task_id=a.task_id, fencing_token=a.token, kind=kind, exit_code=exit_code, message=message)
        if kind in FINAL:
            a.final = ev
            a.phase = "exited"
        self._send(n, pb.AgentMessage(event=ev))

    def _hello(self, n: Node) -> pb.AgentMessage:
        a = self.args
        return pb.AgentMessage(hello=pb.Hello(
            node_id=n.node_id, name=n.node_id, labels=n.labels, credential=n.credential or self.join_token,
            capacity=pb.Resources(cpu_millis=a.cpu_millis, memory_bytes=a.memory_bytes, slots=a.slots),
            backends=["process"], pool="default", arch="x86_64", protocol_min=1, protocol_max=1,
            agent_version=AGENT_VERSION, max_operations=a.slots,  # a simulated node prepares nothing
            batches=True,  # as a real agent: what is queued at a write goes in one AgentBatch
            tasks=[pb.RunningTask(task_id=t.task_id, fencing_token=t.token, phase=t.phase) for t in n.attempts.values()],
        ))  # fmt: skip

    async def run_node(self, n: Node) -> None:
        backoff = BACKOFF_MIN
        # spread the first connects a little so 10,000 Hellos are not one burst
        await asyncio.sleep(random.random() * self.args.connect_jitter)
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                await self._session(n)
            except grpc.aio.AioRpcError as e:
                self.errors[f"stream {e.code().name}: {(e.details() or '')[:80]}"] += 1
                if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    self.counts["refused_nodes"] += 1
                    return  # refused for good: retrying would only measure a reconnect storm
            except (OSError, TimeoutError) as e:
                self.errors[f"stream {type(e).__name__}: {str(e)[:80]}"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug here must not take the whole fleet down
                self.errors[f"bug {type(e).__name__}: {str(e)[:80]}"] += 1
            if self.stopping.is_set():
                return
            self.counts["reconnects"] += 1
            if time.monotonic() - started > 5:
                backoff = BACKOFF_MIN
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), backoff * (0.5 + random.random()))
            backoff = min(BACKOFF_MAX, backoff * 2)

    async def _session(self, n: Node) -> None:
        outq: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        hello = self._hello(n)

        batches = [False]  # whether this server's Welcome said it reads AgentBatch

        async def requests():
            yield hello
            carry: pb.AgentMessage | None = None
            try:
                while True:
                    m, carry = (carry, None) if carry is not None else (await outq.get(), None)
                    if m is None:
                        return
                    if not batches[0]:
                        yield m
                        continue
                    # as a real agent writes: everything queued at this moment in one write
                    batch, carry, ended = take_batch(outq, m, pb.AgentMessage.ByteSize)
                    yield batch[0] if len(batch) == 1 else pb.AgentMessage(batch=pb.AgentBatch(messages=batch))
                    if ended:
                        return
            finally:
                if carry is not None:  # taken but not written: it goes first on the next stream
                    n.buffer.insert(0, carry)

        stub = self.stubs[n.idx // self.args.streams_per_channel]
        # at most --connect-concurrency Hellos wait for their Welcome at once
        await self.hello_gate.acquire()
        gated = True
        hello_sent = time.monotonic()
        call = stub.Connect(requests())
        n.call = call
        beat: asyncio.Task | None = None
        try:
            try:
                first = await asyncio.wait_for(call.read(), timeout=WELCOME_TIMEOUT)
            finally:
                self.hello_gate.release()
                gated = False
            if first is grpc.aio.EOF or not first.HasField("welcome"):
                raise OSError("the server did not answer the Hello with a Welcome")
            now = time.monotonic()
            if self.first_welcome_at is None:
                self.first_welcome_at = now
            w = first.welcome
            if getattr(w, "node_credential", ""):
                n.credential = w.node_credential  # enrolled: from now on the node proves itself
            n.heartbeat_seconds = w.heartbeat_seconds or n.heartbeat_seconds
            batches[0] = w.batches
            n.fence_after = getattr(w, "fence_after_seconds", 0.0) or 0.0
            if n.fence_after:
                n.fence_until = hello_sent + n.fence_after  # the Hello counts as a heartbeat
            self.hello_latency.append(now - hello_sent)
            n.sessions += 1
            self.counts["welcomes"] += 1
            # what is owed from before: unacknowledged ends first, then whatever waited for a stream
            for a in list(n.attempts.values()):
                if a.final is not None:
                    outq.put_nowait(pb.AgentMessage(event=a.final))
            for m in n.buffer:
                if m.HasField("event") and m.event.kind in FINAL:
                    continue
                outq.put_nowait(m)
            n.buffer.clear()
            n.outq = outq
            n.connected = True
            self.connected += 1
            self.max_connected = max(self.max_connected, self.connected)
            if self.connected == len(self.nodes) and self.all_connected_at is None:
                self.all_connected_at = now
            beat = asyncio.get_running_loop().create_task(self._heartbeats(n, outq))
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise OSError("the server closed the stream")
                self._on_message(n, msg)
        finally:
            if gated:
                self.hello_gate.release()
            if n.connected:
                n.connected = False
                self.connected -= 1
            if beat is not None:
                beat.cancel()
            n.outq = None
            n.call = None
            while not outq.empty():
                m = outq.get_nowait()
                if m is not None:
                    n.buffer.append(m)
            call.cancel()

    async def _heartbeats(self, n: Node, outq: asyncio.Queue) -> None:
        seq = 0
        n.beats_sent.clear()
        while True:
            seq += 1
            now = time.monotonic()
            if n.fence_after and n.attempts and now > n.fence_until:
                # a real agent would stop its attempts here (its lease is gone); the fleet counts it,
                # and a run where it happens is not a valid measurement
                self.counts["fence_expired"] += 1
            n.beats_sent[seq] = now
            outq.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq, running=len(n.attempts))))
            self.counts["heartbeats"] += 1
            await asyncio.sleep(n.heartbeat_seconds)

    def _on_message(self, n: Node, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "batch":
            for m in msg.batch.messages:
                self._on_message(n, m)
        elif kind == "assign":
            t = time.monotonic()
            self._on_assign(n, msg.assign, t)
        elif kind == "cancel":
            self._on_cancel(n, msg.cancel)
        elif kind == "ack":
            self.counts["acks"] += 1
            a = n.attempts.get(msg.ack.fencing_token)
            if a is not None and a.final is not None:
                del n.attempts[a.token]
                if a.final.kind == K.EXITED and a.final.exit_code == 0:
                    self.exited_ack_at.setdefault(a.task_id, time.monotonic())
        elif kind == "heartbeat_ack":
            self.counts["heartbeat_acks"] += 1
            seq = msg.heartbeat_ack.seq
            sent = n.beats_sent.get(seq)
            if sent is not None:
                now = time.monotonic()
                if len(self.beat_ack_latency) < 1_000_000:
                    self.beat_ack_latency.append(now - sent)
                if n.fence_after:
                    n.fence_until = max(n.fence_until, sent + n.fence_after)
                for q in [q for q in n.beats_sent if q <= seq]:
                    del n.beats_sent[q]
        elif kind == "drain":
            self.counts["drain_messages"] += 1
        elif kind == "welcome":
            self.counts["unexpected_welcome"] += 1

    def _on_assign(self, n: Node, asg: pb.Assign, t: float) -> None:
        self.counts["assigns"] += 1
        if asg.fencing_token in n.attempts:
            self.counts["redelivered_assigns"] += 1
            return  # a redelivery of what is already running
        if asg.task_id in self.assign_at:
            self.counts["reassigned_tasks"] += 1  # a later attempt of the same task
        else:
            self.assign_at[asg.task_id] = t
            self.node_of[asg.task_id] = n.idx
        a = Attempt(asg.task_id, asg.fencing_token)
        n.attempts[a.token] = a
        self._event(n, a, K.PROVISIONING)
        a.phase = "running"
        self._event(n, a, K.RUNNING)
        if self.duration <= 0:
            self._finish(n, a, 0)
        else:
            a.timer = asyncio.get_running_loop().call_later(self.duration, self._finish, n, a, 0)

    def _finish(self, n: Node, a: Attempt, code: int, message: str = "") -> None:
        if a.final is not None or n.attempts.get(a.token) is not a:
            return
        a.timer = None
        self.counts["exited_sent"] += 1
        self._event(n, a, K.EXITED, exit_code=code, message=message)

    def _on_cancel(self, n: Node, c: pb.Cancel) -> None:
        self.counts["cancels"] += 1
        a = n.attempts.get(c.fencing_token)
        if a is None:
            self._send(n, pb.AgentMessage(event=pb.TaskEvent(
                task_id=c.task_id, fencing_token=c.fencing_token, kind=K.NOT_RUNNING, message="no such attempt here")))  # fmt: skip
            return
        if a.final is not None:
            self._send(n, pb.AgentMessage(event=a.final))
            return
        if a.timer is not None:
            a.timer.cancel()
        self._finish(n, a, 143, "terminated (SIGTERM)")

    # ---- the process ----------------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "t": time.monotonic(),
            "nodes": len(self.nodes),
            "connected": self.connected,
            "max_connected": self.max_connected,
            "assigned_tasks": len(self.assign_at),
            "succeeded_tasks": len(self.exited_ack_at),
            "counts": dict(self.counts),
            "errors": dict(self.errors.most_common(5)),
            "first_welcome_at": self.first_welcome_at,
            "all_connected_at": self.all_connected_at,
        }

    def dump(self) -> None:
        out = {
            "started_at": self.started_at,
            "status": self.status(),
            "errors": dict(self.errors),
            "assign_at": self.assign_at,
            "exited_ack_at": self.exited_ack_at,
            "node_of": self.node_of,
            "sessions": Counter(n.sessions for n in self.nodes).most_common(),
            "hello_latency": self.hello_latency,
            "heartbeat_ack_latency": self.beat_ack_latency,
            "loop_lag": self.loop_lag,
        }
        tmp = Path(self.args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, self.args.out)

    async def watch_lag(self) -> None:
        """How late this process's own loop wakes: a latency the fleet measures that is its own CPU
        starvation, not the server's, shows here (a simulated node answers an Assign at once, so a
        late answer with a lag this size is the fleet's)."""
        while not self.exit.is_set():
            t = time.monotonic()
            await asyncio.sleep(LAG_SAMPLE)
            if len(self.loop_lag) < 100_000:
                self.loop_lag.append(time.monotonic() - t - LAG_SAMPLE)

    async def report(self) -> None:
        while not self.exit.is_set():
            print(json.dumps(self.status()), flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exit.wait(), self.args.status_interval)

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            cmd = line.decode().strip()
            if cmd == "dump":
                self.stopping.set()
                self.dump()
                print(json.dumps({"dumped": True}), flush=True)
            elif cmd == "exit" or not line:
                break
        self.exit.set()

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.exit.set)
        runners = [loop.create_task(self.run_node(n)) for n in self.nodes]
        side = [loop.create_task(self.report()), loop.create_task(self.commands()), loop.create_task(self.watch_lag())]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.exit.wait(), self.args.max_seconds)
        if not self.stopping.is_set():
            self.stopping.set()
            self.dump()
        self.exit.set()
        for n in self.nodes:
            if n.call is not None:
                n.call.cancel()
        for t in runners + side:
            t.cancel()
        await asyncio.gather(*runners, *side, return_exceptions=True)
        for c in self.channels:
            await c.close(grace=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="gateway host:port (loopback only)")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--out", required=True, help="where `dump` writes the records (JSON)")
    p.add_argument("--duration-ms", type=float, default=0.0, help="how long each task 'runs' before EXITED 0")
    p.add_argument("--cpu-millis", type=int, default=16000)
    p.add_argument("--memory-bytes", type=int, default=64 * 2**30)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--prefix", default="bench-node")
    p.add_argument("--streams-per-channel", type=int, default=200, help="agent streams sharing one TCP connection")
    p.add_argument("--connect-concurrency", type=int, default=64, help="Hellos awaiting their Welcome at once")
    p.add_argument("--connect-jitter", type=float, default=0.0, help="seconds over which first connects are spread")
    p.add_argument("--status-interval", type=float, default=0.5)
    p.add_argument("--max-seconds", type=float, default=900.0, help="hard limit on the fleet's life")
    a = p.parse_args(argv)
    host = a.server.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        p.error("the fleet only talks to a server on this machine (127.0.0.1)")
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    async def run() -> None:
        # The fleet holds every node's stream, as the server does, and its collector walked them as
        # the server's did (6-9 s of its 30-36 s of CPU in the placement scenario): CPU taken from
        # the server it measures, on the same two cores. The server's own setting (podium.heap).
        freeze_startup()
        await Fleet(args).main()  # built inside the loop: grpc.aio channels bind to it

    asyncio.run(run())


if __name__ == "__main__":
    main()
