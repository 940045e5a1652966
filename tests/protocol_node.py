"""A node driven by hand over the real agent protocol, for tests that need a node to misbehave on
purpose (a rogue node, a replayed token) or to show what it was sent. It is a protocol client, not a
stand-in for the agent: the real agent is tested as itself elsewhere."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from podium.proto.podium.v1 import agent_pb2 as pb
from podium.proto.podium.v1 import agent_pb2_grpc as pb_grpc


class ProtocolNode:
    def __init__(self, gateway: str, node_id: str, credential: str, *, backends: tuple[str, ...] = ("process",),
                 slots: int = 4, name: str | None = None, egress_contexts: tuple[str, ...] = (),
                 enforces_limits: bool = False, artifacts: tuple[str, ...] = (),
                 heartbeat: float | None = None, batches: bool = False) -> None:  # fmt: skip
        self.node_id = node_id
        self._out: queue.Queue[pb.AgentMessage | None] = queue.Queue()
        self.received: queue.Queue[pb.ServerMessage] = queue.Queue()
        self.batches_received = 0  # ServerBatch writes (their messages are in `received`, in order)
        self.error: grpc.RpcError | None = None
        self._channel = grpc.insecure_channel(gateway)
        stub = pb_grpc.AgentGatewayStub(self._channel)
        hello = pb.Hello(
            node_id=node_id, name=name or node_id, credential=credential, backends=list(backends),
            capacity=pb.Resources(cpu_millis=4000, memory_bytes=8 * 2**30, disk_bytes=2**34, slots=slots),
            protocol_min=1, protocol_max=1, egress_contexts=list(egress_contexts), enforces_limits=enforces_limits,
            artifacts=list(artifacts), max_operations=slots, batches=batches,
        )  # fmt: skip
        self._out.put(pb.AgentMessage(hello=hello))
        self._call = stub.Connect(self._requests())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._closed = threading.Event()
        if heartbeat:
            # heartbeating as an agent does, so the node stays online for as long as a test needs it
            threading.Thread(target=self._beat, args=(heartbeat,), daemon=True).start()

    def _beat(self, every: float) -> None:
        seq = 0
        while self.error is None and not self._closed.wait(every):
            seq += 1
            self.send(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq)))

    def _requests(self) -> Iterator[pb.AgentMessage]:
        while True:
            msg = self._out.get()
            if msg is None:
                return
            yield msg

    def _read(self) -> None:
        try:
            for msg in self._call:
                if msg.WhichOneof("kind") == "batch":
                    self.batches_received += 1
                    for m in msg.batch.messages:
                        self.received.put(m)
                else:
                    self.received.put(msg)
        except grpc.RpcError as e:
            self.error = e

    def send(self, msg: pb.AgentMessage) -> None:
        self._out.put(msg)

    def event(self, task_id: str, token: int, kind: int, exit_code: int = 0) -> None:
        self.send(pb.AgentMessage(event=pb.TaskEvent(task_id=task_id, fencing_token=token, kind=kind, exit_code=exit_code)))

    def next(self, kind: str, timeout: float = 30) -> pb.ServerMessage:
        """The next message of this kind (welcome, assign, cancel, ack, …), skipping others."""
        return self.until(lambda m: m.WhichOneof("kind") == kind, timeout, what=kind)[-1]

    def until(
        self, last: Callable[[pb.ServerMessage], bool], timeout: float = 30, what: str = "the message awaited"
    ) -> list[pb.ServerMessage]:
        """Everything the node is sent, in order, up to and including the first message `last` is true of."""
        import time

        seen: list[pb.ServerMessage] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.received.get(timeout=0.1)
            except queue.Empty:
                if self.error is not None:
                    raise AssertionError(f"stream ended: {self.error.code()} {self.error.details()}") from None
                continue
            seen.append(msg)
            if last(msg):
                return seen
        raise AssertionError(f"no {what} within {timeout}s; sent meanwhile: {[m.WhichOneof('kind') for m in seen]}")

    def wait_closed(self, timeout: float = 30) -> grpc.RpcError:
        self._reader.join(timeout)
        assert self.error is not None, "the stream is still open"
        return self.error

    def close(self) -> None:
        self._closed.set()
        self._out.put(None)
        self._channel.close()
