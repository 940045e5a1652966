"""The agent's reading of its stream from the server (`_read_stream`): every message handed on in
order, an end or a silence told as the reconnect that follows, and a cancel (a session ended for a
new Hello) never lost, whatever loop turn it comes in.

The call here is a stand-in for gRPC's stream (its `read` answers what the test puts in a queue):
what is tested is which loop turn a read ends in against a cancel, and a real stream's turns cannot be
chosen. The agent's real streams are read by this same function in every integration test."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from podium.agent.agent import _read_stream
from podium.proto.podium.v1 import agent_pb2 as pb


class _Call:
    """Stands in for `grpc.aio.StreamStreamCall`: `read` returns what was put, in order."""

    def __init__(self) -> None:
        self.waiting: asyncio.Queue[object] = asyncio.Queue()

    async def read(self) -> object:
        return await self.waiting.get()


def _ack(seq: int) -> pb.ServerMessage:
    return pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq))


async def test_messages_are_handed_on_in_order_and_the_end_of_the_stream_is_an_error() -> None:
    call, seen = _Call(), []
    for seq in range(3):
        call.waiting.put_nowait(_ack(seq))
    call.waiting.put_nowait(grpc.aio.EOF)
    with pytest.raises(OSError, match="the server closed the stream"):
        await _read_stream(call, 30, seen.append)  # type: ignore[arg-type]
    assert [m.heartbeat_ack.seq for m in seen] == [0, 1, 2]


async def test_a_silent_server_ends_the_read_and_each_message_moves_the_deadline() -> None:
    call, seen = _Call(), []

    async def talk() -> None:
        # six messages 0.3 s apart: 1.8 s in all, longer than one silence (a deadline that did not
        # move would fall before the last), and a loop stalled for up to 1.2 s still hears each in time
        for seq in range(6):
            await asyncio.sleep(0.3)
            call.waiting.put_nowait(_ack(seq))

    talker = asyncio.ensure_future(talk())
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(OSError, match=r"the server said nothing for 1.5s"):
        await _read_stream(call, 1.5, seen.append)  # type: ignore[arg-type]
    await talker
    assert [m.heartbeat_ack.seq for m in seen] == [0, 1, 2, 3, 4, 5]  # the deadline moved with each one
    assert loop.time() - began >= 1.8 + 1.5  # and fell a whole silence after the last


async def test_a_cancel_in_the_turn_a_read_ends_ends_the_read() -> None:
    """A session is cancelled (its backends changed: a new Hello) in the loop turn a message arrives,
    or a few turns later. With `asyncio.wait_for` around each read (Python 3.11), a read that ended
    in the cancel's turn returned its message and the cancel was lost: the session read on until the
    stream ended, and the agent's new Hello waited for it."""
    for turns in range(6):
        call, seen = _Call(), []
        reader = asyncio.ensure_future(_read_stream(call, 30, seen.append))  # type: ignore[arg-type]
        for _ in range(3):  # the reader waits in `read`
            await asyncio.sleep(0)
        call.waiting.put_nowait(_ack(turns))
        for _ in range(turns):
            await asyncio.sleep(0)
        reader.cancel()
        done, _ = await asyncio.wait({reader}, timeout=5)
        assert reader in done and reader.cancelled(), f"a cancel {turns} turns after a message was lost"
        assert len(seen) <= 1
