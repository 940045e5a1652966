"""An attempt's `running` waits a moment for its end, to go to the server in the same write (one
change and one commit there instead of two); a longer attempt's goes after the hold, or with its first
output, whichever comes first, and never after anything else of the attempt."""

from __future__ import annotations

import asyncio
from pathlib import Path

from podium.agent.agent import RUNNING_HOLD, Agent, AgentConfig, Attempt
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.timing import DEFAULT_TIMING

K = pb.TaskEvent.Kind
WAIT = 30.0  # seconds a condition may take on a slow, busy machine


def _agent(tmp_path: Path) -> tuple[Agent, Attempt, asyncio.Queue[pb.AgentMessage]]:
    agent = Agent(AgentConfig(servers=["127.0.0.1:1"], state_dir=tmp_path / "state", name="n1"), "node-1", DEFAULT_TIMING)
    q: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()
    agent._outq = q  # a live stream's queue: what the writer would send, in order
    return agent, Attempt("t-1", 7, 1, {"command": ["true"]}), q


def _drain(q: asyncio.Queue[pb.AgentMessage]) -> list[str]:
    out = []
    while not q.empty():
        m = q.get_nowait()
        out.append(K.Name(m.event.kind) if m.HasField("event") else m.WhichOneof("kind"))
    return out


async def test_a_running_waits_for_its_end_and_goes_before_it_in_the_same_turn(tmp_path: Path) -> None:
    agent, a, q = _agent(tmp_path)
    agent._event(a, K.RUNNING, backend_ref="pg:123")
    assert _drain(q) == [], "sent before its end had a chance to come"
    agent._event(a, K.EXITED, exit_code=0)
    assert _drain(q) == ["RUNNING", "EXITED"]
    await asyncio.sleep(RUNNING_HOLD * 4)
    assert _drain(q) == [], "the held `running` was sent twice"


async def test_a_running_whose_end_does_not_come_is_sent_after_the_hold(tmp_path: Path) -> None:
    agent, a, q = _agent(tmp_path)
    agent._event(a, K.RUNNING, backend_ref="pg:123")
    got = await asyncio.wait_for(q.get(), WAIT)
    assert (got.event.kind, got.event.backend_ref, got.event.fencing_token) == (K.RUNNING, "pg:123", 7)
    agent._event(a, K.EXITED, exit_code=3)
    assert _drain(q) == ["EXITED"]


async def test_output_sends_a_held_running_first(tmp_path: Path) -> None:
    agent, a, q = _agent(tmp_path)
    agent._event(a, K.RUNNING, backend_ref="pg:123")
    await agent._emit(a, "stdout", b"hello\n")
    assert _drain(q) == ["RUNNING", "log"]
    agent._event(a, K.EXITED, exit_code=0)
    assert _drain(q) == ["EXITED"]


async def test_a_running_held_while_no_stream_is_up_waits_for_the_next_one(tmp_path: Path) -> None:
    agent, a, _q = _agent(tmp_path)
    agent._outq = None  # the stream went away meanwhile
    agent._event(a, K.RUNNING, backend_ref="pg:123")
    agent._event(a, K.EXITED, exit_code=0)
    assert [m.event.kind for m in agent._buffer] == [K.RUNNING, K.EXITED]
