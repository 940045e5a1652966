"""Several protocol messages in one write (AgentBatch, ServerBatch): what a writer takes from its
queue for one write, and what the gateway writes to agents that read batches and to agents that do not."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from podium.agent.agent import Agent, AgentConfig
from podium.gateway.service import write_out
from podium.gateway.sessions import Session, streams_behind
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.protocol import BATCH_MAX_BYTES, BATCH_MAX_MESSAGES, take_batch
from podium.timing import DEFAULT_TIMING


def _queue(*items: object) -> asyncio.Queue[object]:
    q: asyncio.Queue[object] = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_a_batch_is_what_is_queued_now_in_order() -> None:
    q = _queue("b", "c")
    assert take_batch(q, "a", len) == (["a", "b", "c"], None, False)
    assert q.empty()
    assert take_batch(q, "a", len) == (["a"], None, False)  # nothing queued: one message, no wait


def test_a_batch_stops_at_the_end_of_the_stream() -> None:
    q = _queue("b", None, "never")
    assert take_batch(q, "a", len) == (["a", "b"], None, True)


def test_a_batch_holds_at_most_the_message_limit() -> None:
    q = _queue(*range(1, BATCH_MAX_MESSAGES + 10))
    batch, carry, ended = take_batch(q, 0, lambda _m: 1)
    assert batch == list(range(BATCH_MAX_MESSAGES)) and carry is None and not ended
    assert q.qsize() == 10 and q.get_nowait() == BATCH_MAX_MESSAGES  # the rest waits, in order


def test_a_message_that_would_pass_the_byte_limit_is_carried_to_the_next_write() -> None:
    half = BATCH_MAX_BYTES // 2
    q = _queue(b"y" * half, b"z" * 10, b"w")
    batch, carry, ended = take_batch(q, b"x" * half, len)
    assert batch == [b"x" * half, b"y" * half] and carry == b"z" * 10 and not ended
    assert q.get_nowait() == b"w"  # taken after the carried one, so written after it


def _ack(n: int) -> pb.ServerMessage:
    return pb.ServerMessage(ack=pb.Ack(task_id=f"t{n}", fencing_token=n))


async def _written(batches: bool) -> list[pb.ServerMessage]:
    s = Session("n1", 1, batches=batches)
    s.send(pb.ServerMessage(welcome=pb.Welcome(node_id="n1", batches=True)))
    for n in range(3):
        s.send(_ack(n))
    s.close()
    out: list[pb.ServerMessage] = []

    async def write(msg: pb.ServerMessage) -> None:
        out.append(msg)

    await write_out(s, write)
    return out


async def test_an_agent_that_reads_batches_gets_the_welcome_alone_then_what_was_queued_in_one_write() -> None:
    out = await _written(batches=True)
    assert [m.WhichOneof("kind") for m in out] == ["welcome", "batch"]
    assert list(out[1].batch.messages) == [_ack(0), _ack(1), _ack(2)]


async def test_a_stream_is_writing_since_its_write_began_and_not_once_the_write_is_taken() -> None:
    """What the dispatcher's hold reads: a write the node has not taken yet (gRPC flow control holds
    it while the node does not read) is in progress since it began; a stream writing nothing is not."""
    s = Session("n1", 1, batches=True)
    taken = asyncio.Event()
    began: list[float | None] = []

    async def write(msg: pb.ServerMessage) -> None:
        began.append(s.writing_since)
        await taken.wait()

    writer = asyncio.create_task(write_out(s, write))
    s.send(_ack(0))
    while not began:
        await asyncio.sleep(0)
    assert s.writing_since is not None and s.writing_since == began[0]
    taken.set()
    await asyncio.sleep(0)
    assert s.writing_since is None  # the queue is empty: nothing is being written
    s.close()
    await writer


def test_the_streams_are_as_far_behind_as_more_than_a_quarter_of_them_not_as_the_slowest() -> None:
    assert streams_behind([]) == 0.0
    assert streams_behind([5.0]) == 5.0  # one stream: its own
    assert streams_behind([30.0, 0.0, 0.0, 0.0]) == 0.0  # one node of four stopped reading: no hold
    assert streams_behind([30.0, 4.0, 0.0, 0.0]) == 4.0  # two of four are 4 s behind or more
    assert streams_behind([9.0] * 2000 + [0.0] * 3000) == 9.0  # a fleet whose writes wait
    assert streams_behind([9.0] * 1000 + [0.0] * 4000) == 0.0


async def test_an_agent_that_does_not_say_it_reads_batches_gets_every_message_on_its_own() -> None:
    out = await _written(batches=False)
    assert [m.WhichOneof("kind") for m in out] == ["welcome", "ack", "ack", "ack"]
    assert list(out[1:]) == [_ack(0), _ack(1), _ack(2)]


# ---- the agent's side -----------------------------------------------------------------------------


class _Call:
    """A stream's write side: records what is written; `fail_at` makes that write (1-based) fail."""

    def __init__(self, fail_at: int = 0) -> None:
        self.written: list[pb.AgentMessage] = []
        self.fail_at = fail_at

    async def write(self, msg: pb.AgentMessage) -> None:
        if len(self.written) + 1 == self.fail_at:
            raise asyncio.InvalidStateError("the stream is gone")
        self.written.append(msg)


def _agent(tmp_path: Path) -> Agent:
    cfg = AgentConfig(servers=["127.0.0.1:1"], state_dir=tmp_path / "state", name="n1")
    return Agent(cfg, "node-1", DEFAULT_TIMING)


def _beat(seq: int) -> pb.AgentMessage:
    return pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq))


async def _write_until_drained(agent: Agent, call: _Call, q: asyncio.Queue[pb.AgentMessage], batches: bool) -> None:
    writer = asyncio.get_running_loop().create_task(agent._write(call, q, batches))  # type: ignore[arg-type]
    while not q.empty() and not writer.done():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer


async def test_an_agent_writes_what_is_queued_in_one_batch_to_a_server_that_takes_them(tmp_path: Path) -> None:
    agent, call = _agent(tmp_path), _Call()
    await _write_until_drained(agent, call, _queue(_beat(1), _beat(2), _beat(3)), batches=True)  # type: ignore[arg-type]
    assert [m.WhichOneof("kind") for m in call.written] == ["batch"]
    assert list(call.written[0].batch.messages) == [_beat(1), _beat(2), _beat(3)]


async def test_an_agent_writes_one_message_at_a_time_to_a_server_that_does_not_say_it_takes_batches(tmp_path: Path) -> None:
    agent, call = _agent(tmp_path), _Call()
    await _write_until_drained(agent, call, _queue(_beat(1), _beat(2), _beat(3)), batches=False)  # type: ignore[arg-type]
    assert call.written == [_beat(1), _beat(2), _beat(3)]


async def test_a_message_taken_but_not_written_waits_for_the_next_stream_ahead_of_the_rest(tmp_path: Path) -> None:
    agent, call = _agent(tmp_path), _Call(fail_at=1)
    big = [pb.AgentMessage(log=pb.LogChunk(task_id="t", fencing_token=1, stream="stdout", seq=n, data=b"x" * (BATCH_MAX_BYTES // 2 + 1)))
           for n in range(2)]  # fmt: skip
    q = _queue(big[0], big[1], _beat(1))
    await _write_until_drained(agent, call, q, batches=True)  # type: ignore[arg-type]
    # the first write (big[0] alone: big[1] would pass the byte limit) failed: big[1], already
    # taken from the queue, is kept for the next stream, and the heartbeat after it is still queued
    assert call.written == []
    assert list(agent._buffer) == [big[1]]
    assert q.get_nowait() == _beat(1)
