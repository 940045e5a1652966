"""Several protocol messages in one write (AgentBatch, ServerBatch): what a writer takes from its
queue for one write, and what the gateway writes to agents that read batches and to agents that do not."""

from __future__ import annotations

import asyncio

from podium.gateway.service import write_out
from podium.gateway.sessions import Session
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.protocol import BATCH_MAX_BYTES, BATCH_MAX_MESSAGES, take_batch


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


async def test_an_agent_that_does_not_say_it_reads_batches_gets_every_message_on_its_own() -> None:
    out = await _written(batches=False)
    assert [m.WhichOneof("kind") for m in out] == ["welcome", "ack", "ack", "ack"]
    assert list(out[1:]) == [_ack(0), _ack(1), _ack(2)]
