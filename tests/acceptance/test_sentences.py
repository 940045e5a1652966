"""What Podium tells an operator must be true: a frozen node is told as unreachable, not as absent,
and an ended task says where it ran. Real server, real agent processes, real PostgreSQL, fast timers
(PODIUM_TEST_FAST_TIMERS=1: heartbeat 1s, unreachable 3s, offline 12s)."""

from __future__ import annotations

import signal

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.harness import cli, wait_for

ENDED = ("succeeded", "failed", "cancelled", "lost")
WIDE = {"COLUMNS": "250"}  # one table row per line, whatever the terminal the tests run in


def _row(output: str, key: str) -> list[str]:
    """The words of the one table row that names `key`."""
    rows = [line.split() for line in output.splitlines() if key in line.split()]
    assert len(rows) == 1, output
    return rows[0]


def test_a_frozen_node_is_told_as_unreachable_and_runs_the_task_when_it_thaws(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a")
    node_id = a.node_id()
    cluster.api.wait_node("a", 30, health="online", connected=True)
    # Frozen, the node is unreachable from UnreachableAfter until OfflineAfter (then it is
    # disconnected, and NO_NODES is the truth). Everything below is observed inside that window;
    # on a machine so slow that the window closed before the last look, thaw and look again.
    for _ in range(3):
        a.signal(signal.SIGSTOP)
        try:
            cluster.api.wait_node("a", 30, health="unreachable", connected=True)
            tid = cluster.api.submit(command=["sh", "-c", "echo thawed"])["id"]
            told = wait_for(lambda tid=tid: (t := cluster.api.task(tid))["reason"] != reasons.WAITING and t, 30,
                            what="placement to tell the task why it waits")  # fmt: skip
            explained = cli(srv.api, "explain", tid, extra_env=WIDE)
            listed = cli(srv.api, "nodes", extra_env=WIDE)
            node = next(n for n in cluster.api.nodes() if n["id"] == node_id)
            window_held = node["health"] == "unreachable" and node["connected"]
        finally:
            a.signal(signal.SIGCONT)
        if window_held:
            break
        cluster.api.wait_state(tid, ENDED, 60)  # it ran once the node came back; try again
        cluster.api.wait_node("a", 30, health="online", connected=True)
    else:
        raise AssertionError("the node never stayed unreachable long enough to be looked at")

    # the queued task says what is true, and never that no node is connected
    assert (told["state"], told["reason"]) == ("queued", reasons.UNREACHABLE)
    # `podium explain` shows the node as unreachable, with the sentence as its failed check
    assert explained.returncode == 0, explained.stderr
    assert reasons.UNREACHABLE in " ".join(explained.stdout.split())
    assert reasons.NO_NODES not in " ".join(explained.stdout.split())
    row = _row(explained.stdout, node_id)
    assert row[1:4] == ["a", "unreachable", "no"], row
    # the node listing shows health beside connected: connected, and unreachable
    assert listed.returncode == 0, listed.stderr
    row = _row(listed.stdout, node_id)
    assert row[1:4] == ["a", "unreachable", "yes"], row
    assert (node["health"], node["connected"]) == ("unreachable", True)

    # thawed, the node heartbeats again and runs the task
    cluster.api.wait_node("a", 30, health="online", connected=True)
    done = cluster.api.wait_state(tid, ENDED, 60)
    assert done["state"] == "succeeded"
    assert cli(srv.api, "logs", tid).stdout == "thawed\n"


def test_an_ended_task_names_the_node_its_last_attempt_ran_on(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a")
    node_id = a.node_id()
    tid = cluster.api.submit(command=["true"])["id"]
    done = cluster.api.wait_state(tid, ENDED, 60)
    assert done["state"] == "succeeded"
    # it holds no node any more, and still says where it ran
    assert done["node_id"] is None
    assert (done["last_node_id"], done["last_node_name"]) == (node_id, "a")
    listed = cluster.api.http.get("/v1/tasks").json()
    assert [(t["last_node_id"], t["last_node_name"]) for t in listed if t["id"] == tid] == [(node_id, "a")]

    shown = cli(srv.api, "show", tid, extra_env=WIDE)
    assert shown.returncode == 0, shown.stderr
    assert f"ran on:   a ({node_id})" in shown.stdout, shown.stdout
    ls = cli(srv.api, "ls", "--wide", extra_env=WIDE)
    assert ls.returncode == 0, ls.stderr
    row = _row(ls.stdout, tid)
    assert "succeeded" in row and node_id in row, row
