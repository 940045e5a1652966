"""A task forked by an agent that dies before it could tell its fence keeper (the fork and the `add`
are a few event-loop turns apart) is still killed: the keeper sweeps for the node's orphaned task
groups when the agent's end of its pipe closes. A task of the same node whose agent is alive (another
instance of the node) is left alone. Real processes: an "agent" that is a real FenceKeeper's parent,
killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

from tests.harness import pid_alive, wait_for

AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from podium.agent.fence import FenceKeeper
    keeper = FenceKeeper(None, node=sys.argv[1])
    keeper.renew(time.monotonic() + 600)
    env = dict(os.environ, PODIUM_NODE_ID=sys.argv[1], PODIUM_TASK_ID="t-" + sys.argv[2])
    task = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    if sys.argv[2] == "registered":
        keeper.add(task.pid, "t-registered", 1)
    keeper_pid = keeper.proc.pid
    if sys.argv[2] == "closes":
        keeper.close()  # a clean shutdown: the agent lives on while its keeper goes
    print(task.pid, keeper_pid, flush=True)
    time.sleep(600)
""")


def _end(agent: subprocess.Popen[str], task: int) -> None:
    """Whatever a test left running: the stand-in agent, and the task's group."""
    agent.kill()
    agent.wait(10)
    assert agent.stdout is not None
    agent.stdout.close()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(task, signal.SIGKILL)


def _agent(node: str, how: str) -> tuple[subprocess.Popen[str], int, int]:
    p = subprocess.Popen([sys.executable, "-c", AGENT, node, how], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    task, keeper = (int(x) for x in p.stdout.readline().split())
    return p, task, keeper


def test_the_keeper_kills_a_task_its_dead_agent_never_registered() -> None:
    node = f"orphan-test-{os.getpid()}"
    dying, orphan, keeper = _agent(node, "unregistered")
    living, sibling, _ = _agent(node, "unregistered")  # the same node id, an agent that stays alive
    other, stranger, _ = _agent(node + "-other", "unregistered")  # another node's task
    try:
        assert pid_alive(orphan) and pid_alive(sibling)
        dying.send_signal(signal.SIGKILL)
        dying.wait(10)
        wait_for(lambda: not pid_alive(keeper), 30, what="the keeper to notice its agent is gone and exit")
        assert not pid_alive(orphan), "a task its dead agent never registered outlived it"
        assert pid_alive(sibling), "a task of a live agent of the same node was killed"
        assert pid_alive(stranger), "another node's task was killed"
    finally:
        for p in (dying, living, other):
            p.kill()
            p.wait(10)
            assert p.stdout is not None
            p.stdout.close()
        for pid in (orphan, sibling, stranger):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_registered_task_dies_with_its_agent() -> None:
    agent, task, keeper = _agent(f"orphan-test-{os.getpid()}-r", "registered")
    try:
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: not pid_alive(task), 30, what="the keeper to kill the registered task")
    finally:
        _end(agent, task)


def test_a_keeper_closed_by_its_living_agent_leaves_the_agents_children_alone() -> None:
    agent, task, keeper = _agent(f"orphan-test-{os.getpid()}-c", "closes")
    try:
        assert not pid_alive(keeper)  # close() waited for it
        assert pid_alive(task), "a clean close of the keeper killed a child of the living agent"
    finally:
        _end(agent, task)
