"""The promises under faults: real server, real agent processes, real PostgreSQL, fast timers
(PODIUM_TEST_FAST_TIMERS=1: heartbeat 1s, unreachable 3s, offline 12s, accept 1.5s, cancel grace 6s,
kill grace 3s). Every test compares the server's story with what the agents actually ran."""

from __future__ import annotations

import signal
import time
from datetime import datetime

from podium import reasons
from podium.timing import timing_from_env
from tests.acceptance.conftest import Cluster
from tests.harness import assert_at_most_one_attempt_at_once, cli, pid_alive, wait_for

T = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1"})
ENDED = ("succeeded", "failed", "cancelled", "lost")


def running_on(cluster: Cluster, tid: str, name: str, timeout: float = 60) -> dict:
    node_id = next(a for a in cluster.agents if a.name == name).node_id()
    return wait_for(lambda: (t := cluster.api.task(tid))["state"] == "running" and t["node_id"] == node_id and t,
                    timeout, what=f"task {tid} running on {name}")  # fmt: skip


def test_agent_killed_mid_task_requeues_after_offline_not_before(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("a", labels={"side": "a"})
    tid = cluster.api.submit(command=["sh", "-c", "sleep 3; echo done"], labels={"side": "a"})["id"]
    running_on(cluster, tid, "a")
    child = wait_for(lambda: [e for e in a.journal_entries() if e["ev"] == "start"], 30)[0]["pid"]
    a.kill()
    # the task's process does not outlive its agent
    wait_for(lambda: not pid_alive(child), 10, what="the task's process to die with its agent")
    # node unreachable, task undisturbed (the server cannot know the node is gone for good)
    node = cluster.api.wait_node("a", 30, health="unreachable")
    assert cluster.api.task(tid)["state"] == "running"
    requeued = wait_for(lambda: (t := cluster.api.task(tid))["attempts"] >= 1 and t["state"] != "running" and t, 60,
                        what="the node-loss policy")  # fmt: skip
    # not before OfflineAfter past the node's last recorded heartbeat, both by the database's clock (a
    # client's clock from the kill would also count however late the agent's last heartbeat was)
    silent = datetime.fromisoformat(requeued["attempt_list"][0]["finished_at"]) - datetime.fromisoformat(node["last_heartbeat_at"])
    assert silent.total_seconds() >= T.offline_after, f"lost {silent} after the last heartbeat, before OfflineAfter"
    assert requeued["state"] == "queued"
    assert requeued["attempt_list"][0]["state"] == "lost" and requeued["attempt_list"][0]["reason"] == reasons.NODE_LOST
    cluster.agent("b", labels={"side": "a"})
    done = cluster.api.wait_state(tid, ENDED, 60)
    assert done["state"] == "succeeded" and len(done["attempt_list"]) == 2
    assert_at_most_one_attempt_at_once(cluster.agents)


def test_agent_killed_when_spec_forbids_requeue_is_lost(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("a")
    tid = cluster.api.submit(command=["sleep", "30"], requeue_on_node_loss=False)["id"]
    running_on(cluster, tid, "a")
    a.kill()
    t = cluster.api.wait_state(tid, ENDED, 60)
    assert (t["state"], t["reason"]) == ("lost", reasons.NODE_LOST)
    assert cluster.api.nodes()[0]["reserved"]["slots"] == 0


def test_agent_paused_shorter_than_offline_is_left_alone(cluster: Cluster) -> None:
    # The pause must end before the agent's own fence (two heartbeats short of OfflineAfter, counted
    # from its last *acknowledged* heartbeat, which may be 3.5 s older than the pause): with tenfold
    # timers that is 6.5-10 s into the pause, while the 8 s task may still run, and a slow machine's
    # polls and the sleep this test had took up to 7 s of it. Timers five times faster here:
    # unreachable after 6 s, the fence 17-20 s into the pause.
    gentler = {"PODIUM_TEST_TIMER_DIVISOR": "5"}
    cluster.server(extra_env=gentler)
    a = cluster.agent("a", extra_env=gentler)
    tid = cluster.api.submit(command=["sh", "-c", "sleep 8; echo survived"])["id"]
    running_on(cluster, tid, "a")
    a.signal(signal.SIGSTOP)
    try:
        # past UnreachableAfter with no heartbeat, short of OfflineAfter: its task is left as it is
        cluster.api.wait_node("a", 60, health="unreachable")
        assert cluster.api.task(tid)["state"] == "running"
    finally:
        a.signal(signal.SIGCONT)
    cluster.api.wait_node("a", 30, health="online")
    t = cluster.api.wait_state(tid, ENDED, 60)
    assert t["state"] == "succeeded" and len(t["attempt_list"]) == 1
    assert cli(cluster.servers[0].api, "logs", tid).stdout == "survived\n"


def test_agent_paused_past_offline_is_fenced_and_its_late_events_rejected(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("a", labels={"x": "1"})
    tid = cluster.api.submit(command=["sh", "-c", "sleep 20; echo finished"], labels={"x": "1"}, max_attempts=3)["id"]
    first = running_on(cluster, tid, "a")
    child = wait_for(lambda: [e for e in a.journal_entries() if e["ev"] == "start"], 30)[0]["pid"]
    a.signal(signal.SIGSTOP)  # the agent only: its task and its fence keeper run on
    try:
        # the fence keeper stops the task before the server may declare the node offline
        wait_for(lambda: not pid_alive(child), 30, what="the fence to stop the old attempt")
        assert cluster.api.task(tid)["fencing_token"] == first["fencing_token"]
        cluster.agent("b", labels={"x": "1"}, slots=1)
        second = running_on(cluster, tid, "b", 60)
        assert second["fencing_token"] > first["fencing_token"]
        assert second["attempt_list"][0]["state"] == "lost"
    finally:
        a.signal(signal.SIGCONT)
    # the old attempt's late report is refused: exactly one success, on b
    t = cluster.api.wait_state(tid, ENDED, 90)
    assert t["state"] == "succeeded" and t["node_id"] is None
    assert [x["state"] for x in t["attempt_list"]] == ["lost", "exited"]
    assert t["attempt_list"][1]["node_id"] == cluster.agents[1].node_id()
    assert [e["to_state"] for e in t["events"]].count("succeeded") == 1
    assert "rejected" in cluster.servers[0].output()
    assert_at_most_one_attempt_at_once(cluster.agents)


def test_node_that_never_accepts_is_revoked_and_work_runs_elsewhere(cluster: Cluster) -> None:
    cluster.server()
    cluster.agent("mute", extra_env={"PODIUM_TEST_AGENT_DROP_ASSIGNS": "1"})
    # Attempts enough for the mute node to spend while the good agent starts, however slowly this
    # machine starts a process: each one costs the mute node only an accept deadline.
    tid = cluster.api.submit(command=["echo", "ok"], max_attempts=100)["id"]
    t = wait_for(lambda: (x := cluster.api.task(tid))["attempts"] >= 1 and x, 30)
    cluster.agent("good")
    t = cluster.api.wait_state(tid, ENDED, 180)
    assert t["state"] == "succeeded"
    revoked = [x for x in t["attempt_list"] if x["state"] == "revoked"]
    assert revoked and all(x["reason"] == reasons.NOT_ACCEPTED for x in revoked)
    assert {x["node_id"] for x in revoked} == {cluster.agents[0].node_id()}
    assert t["attempt_list"][-1]["node_id"] == cluster.agents[1].node_id()


def test_no_attempts_left_fails_with_not_accepted(cluster: Cluster) -> None:
    cluster.server()
    cluster.agent("mute", extra_env={"PODIUM_TEST_AGENT_DROP_ASSIGNS": "1"})
    tid = cluster.api.submit(command=["echo", "ok"], max_attempts=1)["id"]
    t = cluster.api.wait_state(tid, ENDED, 60)
    assert (t["state"], t["reason"]) == ("failed", reasons.NOT_ACCEPTED)


def test_timeout_stops_the_task_and_fails_it(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a")
    r = cli(srv.api, "run", "--timeout", "1s", "--", "sleep", "600")
    assert r.returncode == 124 and "timeout" in r.stderr
    t = cluster.api.task(cli(srv.api, "ls", "--json").stdout and cluster.api.http.get("/v1/tasks").json()[0]["id"])
    assert (t["state"], t["reason"]) == ("failed", reasons.TIMEOUT)
    pid = [e for e in a.journal_entries() if e["ev"] == "start"][0]["pid"]
    assert not pid_alive(pid)


def test_cancel_while_provisioning(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("slow", extra_env={"PODIUM_TEST_AGENT_PROVISION_DELAY": "3"})
    tid = cluster.api.submit(command=["sleep", "600"])["id"]
    cluster.api.wait_state(tid, "provisioning", 30)
    cluster.api.http.post(f"/v1/tasks/{tid}/cancel")
    t = cluster.api.wait_state(tid, ENDED, 30)
    assert t["state"] == "cancelled"
    # confirmed by the node, not by the grace: it never started the command
    assert t["events"][-1]["actor"].startswith("node:")
    assert not [e for e in a.journal_entries() if e["ev"] == "start"]


def test_cancel_on_an_unreachable_node_is_written_by_the_server_after_the_grace(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("a")
    tid = cluster.api.submit(command=["sleep", "600"])["id"]
    running_on(cluster, tid, "a")
    pid = wait_for(lambda: [e for e in a.journal_entries() if e["ev"] == "start"], 30)[0]["pid"]
    a.signal(signal.SIGSTOP)
    try:
        cluster.api.wait_node("a", 30, health="unreachable")
        cancelled_at = time.monotonic()
        cluster.api.http.post(f"/v1/tasks/{tid}/cancel")
        t = cluster.api.wait_state(tid, ENDED, 30)
        assert t["state"] == "cancelled" and t["events"][-1]["actor"].startswith("scheduler:")
        assert time.monotonic() - cancelled_at >= T.cancel_grace - 0.5
    finally:
        a.signal(signal.SIGCONT)
    wait_for(lambda: not pid_alive(pid), 30, what="the process to be stopped once the node is back")
    assert cluster.api.nodes()[0]["reserved"]["slots"] == 0
