"""Who killed an attempt, known rather than guessed (issue 14: the 30-minute campaign, seed 20261201,
found a task stored `failed` with exit 137 whose command never wrote its first line).

Every way a SIGKILL the task did not ask for can reach an attempt, each with a real agent (the
`Agent` class, in this process: the server's messages are fed to it as the protocol's own messages,
its reports read from what it would send), a real fence keeper process and real process groups:

- the lease ran out after the Assign and before the start: the attempt is never started;
- the lease ran out between the agent's last look and the start (an agent stalled right there): the
  keeper kills at once, a late acknowledgement renews the lease before the agent sees the exit, and
  the keeper's own word says it was the fence;
- the agent is superseded, or shut down: the end is the agent's, not the task's;
- a process group number reused by another process once its attempt ended: neither the keeper nor
  a superseded agent kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from podium.agent import fence
from podium.agent.agent import Agent, AgentConfig, Attempt, Superseded
from podium.agent.fence import FenceKeeper, identity, pidfs, pidfs_inode, same_group, start_time
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.timing import DEFAULT_TIMING, FAST_TIMER_DIVISOR
from tests.harness import wait_for

K = pb.TaskEvent.Kind
TIMING = DEFAULT_TIMING.scaled(FAST_TIMER_DIVISOR)


def _dead(pid: int) -> bool:
    """Dead: gone, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


async def _until(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition", every: float = 0.01) -> None:
    """Let the agent's loop run until `cond` holds (looking again after each turn of the loop with
    `every=0`, so the test holds the loop right after the step that made it true)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


def _agent(tmp_path: Path) -> Agent:
    cfg = AgentConfig(servers=["127.0.0.1:1"], state_dir=tmp_path / "state", name="n1", journal=tmp_path / "journal")
    return Agent(cfg, "node-1", TIMING)


def _assign(agent: Agent, token: int, command: list[str]) -> Attempt:
    spec = {"command": command}
    agent._on_message(pb.ServerMessage(assign=pb.Assign(task_id=f"task-{token}", fencing_token=token, attempt=1,
                                                        spec_json=json.dumps(spec))))  # fmt: skip
    return agent.attempts[token]


def _accept(agent: Agent, a: Attempt) -> None:
    agent._on_message(pb.ServerMessage(accepted=pb.Accepted(task_id=a.task_id, fencing_token=a.token)))


def _late_ack(agent: Agent) -> None:
    """The acknowledgement of a heartbeat sent just now: the lease is renewed from here."""
    seq = max(agent._beats_sent, default=0) + 1
    agent._beats_sent[seq] = time.monotonic()
    agent._on_message(pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq)))


async def _end(agent: Agent, a: Attempt) -> pb.TaskEvent:
    await _until(lambda: a.final is not None, what="the attempt's end")
    assert a.final is not None
    return a.final


@pytest.fixture
async def agent(tmp_path: Path) -> Any:
    ag = _agent(tmp_path)
    await ag._fingerprint()
    yield ag
    for a in ag.attempts.values():
        if a.runner is not None and not a.runner.done():
            a.runner.cancel()
    await asyncio.gather(*(a.runner for a in ag.attempts.values() if a.runner is not None), return_exceptions=True)
    ag.fence.close()


async def test_an_attempt_is_never_started_once_the_lease_ran_out_after_its_assign(agent: Agent) -> None:
    # The campaign's anomaly, as the code before this fix lets it happen: the lease is live when the
    # Assign comes, runs out before the server's Accepted is read (a stopped agent), the agent
    # starts the command anyway, the keeper kills it at once, and the late acknowledgement of a
    # heartbeat renews the lease before the agent sees the exit: "exited 137", a task failed for good.
    agent.fence.renew(time.monotonic() + 0.3)
    a = _assign(agent, 5, ["sleep", "30"])
    await _until(lambda: a.phase == "provisioning" and any(
        m.HasField("event") and m.event.kind == K.PROVISIONING for m in agent._buffer), what="provisioning")  # fmt: skip
    await _until(lambda: agent.fence.expired(), what="the lease to run out")
    _accept(agent, a)
    await _until(lambda: a.handle is not None or a.final is not None, what="a start or an end", every=0)
    if a.handle is not None:  # started (the old code): hold the loop as a stopped agent would
        pid = int(a.handle.ref)
        wait_for(lambda: _dead(pid), 30, what="the fence keeper to kill the attempt")
        _late_ack(agent)
    end = await _end(agent, a)
    assert end.kind == K.FAILED_RETRYABLE, end
    assert a.handle is None, "started with a lease that had run out"
    assert "not started on this node" in end.message


async def test_a_kill_at_the_start_is_known_to_be_the_fences_after_a_late_renewal(agent: Agent) -> None:
    # The lease is live when the agent decides to start; the start itself stalls past the deadline
    # (an agent stopped or starved right there), so the keeper kills the group the moment it is
    # registered, and a late acknowledgement comes before the exit is seen. The lapse fell before
    # the attempt's start: no clock comparison can tell it was the fence, the keeper's word does.
    backend = agent.backends["process"]
    real_start = backend.start

    async def stalled_start(*args: Any) -> Any:  # the real start, after a stall past the deadline
        await _until(lambda: agent.fence.expired(), what="the lease to run out")
        return await real_start(*args)

    backend.start = stalled_start  # type: ignore[method-assign]
    agent.fence.renew(time.monotonic() + 0.5)
    a = _assign(agent, 6, ["sleep", "30"])
    _accept(agent, a)
    await _until(lambda: a.handle is not None, what="the start", every=0)
    pid = int(a.handle.ref)  # type: ignore[union-attr]
    wait_for(lambda: _dead(pid), 30, what="the fence keeper to kill the attempt")
    _late_ack(agent)
    assert not agent.fence.expired()  # what the agent sees now: a live lease
    end = await _end(agent, a)
    assert end.kind == K.FAILED_RETRYABLE, end
    assert "no heartbeat acknowledged" in end.message


async def test_a_task_that_exits_by_itself_is_reported_as_itself(agent: Agent, tmp_path: Path) -> None:
    # the other side: the keeper's word is needed for a fenced end, an exit of its own is its own
    agent.fence.renew(time.monotonic() + 60)
    a = _assign(agent, 7, ["sh", "-c", "exit 137"])  # dies "of SIGKILL" by its own doing
    _accept(agent, a)
    end = await _end(agent, a)
    assert (end.kind, end.exit_code) == (K.EXITED, 137)


async def test_a_superseded_agent_reports_its_kills_as_its_own_and_spares_reused_numbers(agent: Agent) -> None:
    agent.fence.renew(time.monotonic() + 60)
    done = _assign(agent, 8, ["true"])
    _accept(agent, done)
    assert (await _end(agent, done)).kind == K.EXITED  # ended, its end not yet acknowledged
    # its process group number now names another process (pids are reused); simulated by pointing
    # the ended attempt's handle at a group of our own
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert done.handle is not None
        done.handle.ref = str(other.pid)
        running = _assign(agent, 9, ["sleep", "30"])
        _accept(agent, running)
        await _until(lambda: running.handle is not None, what="the start")
        with pytest.raises(Superseded):
            agent._on_message(pb.ServerMessage(superseded=pb.Superseded(reason="superseded", instance_id="other/1/x")))
        end = await _end(agent, running)
        # The agent's own kills are sent before `_superseded` returns, and the keeper was never told
        # of this group: by the time the running attempt's end is seen, a kill of it would have landed.
        assert not _dead(other.pid), "a superseded agent killed a process group that was no longer its own"
        assert end.kind == K.FAILED_RETRYABLE and "superseded" in end.message, end
    finally:
        other.kill()
        other.wait()


async def test_an_attempt_stopped_by_the_agents_shutdown_is_not_the_tasks_exit(agent: Agent) -> None:
    agent.fence.renew(time.monotonic() + 60)
    a = _assign(agent, 10, ["sleep", "30"])
    _accept(agent, a)
    await _until(lambda: a.handle is not None, what="the start")
    waiting = _assign(agent, 11, ["sleep", "30"])  # never accepted: ends without starting
    await agent.shutdown()
    end = await _end(agent, a)
    assert end.kind == K.FAILED_RETRYABLE and "shut down" in end.message, end
    assert (await _end(agent, waiting)).kind == K.FAILED_RETRYABLE and waiting.handle is None


@contextlib.contextmanager
def _keeper_and_groups(n: int, node: str | None = None) -> Iterator[tuple[FenceKeeper, list[subprocess.Popen[bytes]]]]:
    """A fence keeper (of `node`, if given) and `n` live process groups (`sleep`), all gone afterwards."""
    keeper = FenceKeeper(None, node=node)
    groups = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(n)]
    try:
        yield keeper, groups
    finally:
        for p in groups:
            p.kill()
            p.wait()
        keeper.close()


def test_the_keeper_says_what_it_killed_and_why() -> None:
    with _keeper_and_groups(2) as (keeper, (victim, survivor)):
        keeper.renew(time.monotonic() + 0.3)
        keeper.add(victim.pid, "task", 7)
        keeper.add(survivor.pid, "task2", 8)
        keeper.remove(survivor.pid)  # ended by itself, as far as the agent knows
        wait_for(lambda: victim.poll() is not None, 30, what="the fence keeper to kill the attempt")
        assert victim.returncode == -signal.SIGKILL
        keeper.renew(time.monotonic() + 30)  # the late acknowledgement
        assert not keeper.expired()
        assert keeper.killed(7) == "lease expired"
        assert keeper.killed(7) is None  # said once
        assert keeper.killed(8) is None and survivor.poll() is None


async def test_an_ended_group_is_told_to_the_keeper_soon_with_nothing_else_to_write() -> None:
    """In the agent (a running loop) an ended group's `del` waits for the next line to ride with, for
    HOLD_DELS at most: with nothing else written the keeper still hears it before the lease runs out,
    and the lapse kills only the group still fenced (both are alive here: a `del` that never arrived
    would show as a kill)."""
    with _keeper_and_groups(2) as (keeper, (ended, fenced)):
        keeper.renew(time.monotonic() + 3)
        keeper.add(ended.pid, "ended", 1)
        keeper.add(fenced.pid, "fenced", 2)
        keeper.remove(ended.pid)  # the last line this test writes
        await asyncio.sleep(fence.HOLD_DELS * 4)
        wait_for(lambda: fenced.poll() is not None, 30, what="the keeper to kill the group still fenced")
        assert keeper.killed(2) == "lease expired"
        assert ended.poll() is None, "the keeper never heard that the group ended"


async def test_groups_started_in_one_turn_of_the_loop_are_told_in_one_write_and_all_fenced() -> None:
    """An agent starts a batch of accepted attempts in one turn of its loop: the keeper hears of them
    all in one pipe write at the next turn (one wake of it, not one per start), and fences every one."""
    with _keeper_and_groups(16, node="n-batch") as (keeper, groups):
        keeper.renew(time.monotonic() + 3)  # nothing renews it again: the keeper fences them all then
        keeper._ensure()
        writes: list[str] = []
        write = keeper._write

        def counted(line: str, ensure: bool = True) -> None:
            writes.append("".join(keeper._held) + line)  # what goes down the pipe
            write(line, ensure)

        keeper._write = counted  # type: ignore[method-assign]
        for i, p in enumerate(groups):
            keeper.add(p.pid, f"task-{i}", 100 + i)
        assert writes == []  # nothing yet: the turn is not over
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(writes) == 1 and writes[0].count("add ") == 16, writes
        for i, p in enumerate(groups):
            wait_for(lambda p=p: p.poll() is not None, 30, what=f"group {i} to be killed at the lapse")
        assert [keeper.killed(100 + i) for i in range(16)] == ["lease expired"] * 16


async def test_a_group_whose_add_is_held_by_a_stalled_loop_is_killed_at_the_lapse_and_known_as_fenced() -> None:
    """The `add` of a group waits for the end of the agent's loop turn; a loop that stalls right there
    past the lease (an agent stopped or starved) never writes it. The keeper's sweep at the lapse finds
    the group among the agent's children by the node in its environment, kills it, and names it by
    its number, so the agent knows the fence killed it."""
    node = "n-stalled"
    keeper = FenceKeeper(None, node=node)
    env = {**os.environ, "PODIUM_NODE_ID": node, "PODIUM_TASK_ID": "t-held"}
    keeper.renew(time.monotonic() + 2)  # nothing renews it again
    keeper._ensure()
    group = subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)
    try:
        keeper.add(group.pid, "t-held", 21)
        assert keeper._held, "the add was written at once: this test needs it held"
        # the loop is stalled from here on: this waits without yielding to it
        wait_for(lambda: group.poll() is not None, 30, what="the keeper to kill the group it was never told of")
        assert group.returncode == -signal.SIGKILL
        assert keeper.killed(21) == "lease expired"
    finally:
        group.kill()
        group.wait()
        keeper.close()


def test_the_keeper_never_kills_a_group_number_another_process_has_taken() -> None:
    # A group registered, ended and reaped while the agent's `del` was on its way; its number is now
    # another process's. Simulated by registering a live group with a start time that is not its own.
    with _keeper_and_groups(2) as (keeper, (other, mine)):
        started = start_time(other.pid)
        assert started
        keeper.renew(time.monotonic() + 0.3)
        keeper._write(f"add {other.pid} old-task 3 {started - 1}\n")
        keeper.add(mine.pid, "task", 4)
        wait_for(lambda: mine.poll() is not None, 30, what="the fence keeper to kill at the deadline")
        assert other.poll() is None, "the keeper killed a group whose number had been reused"
        assert keeper.killed(4) == "lease expired"


@pytest.mark.skipif(not pidfs(), reason="a kernel without pidfs (Linux < 6.9): groups are named by start time")
def test_a_group_is_named_by_its_leaders_pidfs_inode_and_another_process_is_spared() -> None:
    # As above, with the name the agent gives a group it started (its pidfd's inode): a registered
    # inode that is not the process's now means the number was reused, and that group is not killed
    with _keeper_and_groups(2) as (keeper, (other, mine)):
        ino = pidfs_inode(other.pid)
        assert ino is not None and identity(other.pid) == f"i{ino}" and same_group(other.pid, f"i{ino}")
        assert not same_group(other.pid, f"i{ino + 1}")
        keeper.renew(time.monotonic() + 0.3)
        keeper._write(f"add {other.pid} old-task 3 i{ino + 1}\n")
        keeper.add(mine.pid, "task", 4, identity(mine.pid))
        wait_for(lambda: mine.poll() is not None, 30, what="the fence keeper to kill at the deadline")
        assert other.poll() is None, "the keeper killed a group whose number had been reused"
        assert keeper.killed(4) == "lease expired"
    # a leader already reaped: its number may still be its group's (taken while a member lives)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert same_group(gone.pid, f"i{ino}")


def test_a_restarted_keeper_still_reports_its_kills() -> None:
    with _keeper_and_groups(1) as (keeper, (proc,)):
        keeper.renew(time.monotonic() + 60)
        first = keeper._ensure()
        first.kill()  # the keeper dies; the next command starts another, told everything
        first.wait()
        keeper.add(proc.pid, "task", 12)
        assert keeper.proc is not None and keeper.proc.pid != first.pid
        keeper.fence_now("superseded")
        wait_for(lambda: proc.poll() is not None, 30, what="the kill")
        wait_for(lambda: keeper.killed(12) is not None or None, 30, what="the new keeper's word")
