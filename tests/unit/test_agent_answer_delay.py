"""The fault-test knob of a node slow to answer its Assigns (`answer_delay`, PODIUM_TEST_AGENT_ANSWER_DELAY):
its `provisioning` goes that long after the Assign, and never after the attempt was cancelled or ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from podium.agent.agent import Agent, AgentConfig, Attempt
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.timing import DEFAULT_TIMING

K = pb.TaskEvent.Kind
WAIT = 30.0  # seconds a condition may take on a slow, busy machine
NEVER = 3600.0  # an answer delay no test waits out


@contextlib.asynccontextmanager
async def _assigned(tmp_path: Path, delay: float) -> AsyncIterator[tuple[Agent, Attempt, asyncio.Queue[pb.AgentMessage]]]:
    cfg = AgentConfig(servers=["127.0.0.1:1"], state_dir=tmp_path / "state", name="n1", answer_delay=delay)
    agent = Agent(cfg, "node-1", DEFAULT_TIMING)
    q: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()
    agent._outq = q  # a live stream's queue: what the writer would send, in order
    agent._on_assign(pb.Assign(task_id="t-1", fencing_token=7, attempt=1, spec_json='{"command": ["true"]}'))
    a = agent.attempts[7]
    try:
        yield agent, a, q
    finally:
        assert a.runner is not None
        a.runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await a.runner


def _events(q: asyncio.Queue[pb.AgentMessage]) -> list[str]:
    out = []
    while not q.empty():
        m = q.get_nowait()
        if m.HasField("event"):
            out.append(K.Name(m.event.kind))
    return out


async def test_a_slow_node_does_not_answer_its_assign_at_once(tmp_path: Path) -> None:
    async with _assigned(tmp_path, NEVER) as (_agent, _a, q):
        for _ in range(20):
            await asyncio.sleep(0)  # the attempt's task runs as far as it can without its Accepted
        assert "PROVISIONING" not in _events(q), "answered at once, as a node with no delay does"


async def test_a_slow_node_answers_its_assign_after_the_delay(tmp_path: Path) -> None:
    async with _assigned(tmp_path, 0.05) as (_agent, _a, q):
        got = await asyncio.wait_for(q.get(), WAIT)
        assert (got.event.kind, got.event.task_id, got.event.fencing_token) == (K.PROVISIONING, "t-1", 7)


async def test_a_slow_node_never_answers_an_assign_cancelled_meanwhile(tmp_path: Path) -> None:
    async with _assigned(tmp_path, NEVER) as (agent, a, q):
        agent._on_cancel(pb.Cancel(task_id="t-1", fencing_token=7, reason="cancelled"))
        await asyncio.sleep(0)
        agent._answer_late(a)  # the delay runs out now
        assert "PROVISIONING" not in _events(q), "a `provisioning` after the attempt was cancelled"
