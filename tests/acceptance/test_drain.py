"""Drain phases with real agents (fast timers): active → draining (no new work; running work
finishes) → drained (nothing on it), `podium drain --wait`, and `--deadline`, past which what still
runs there goes through each task's node-loss policy: requeued if the spec allows it and attempts
remain, else lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.acceptance.test_faults import running_on
from tests.harness import base_env, cli, held_until, wait_for


def test_drain_wait_returns_when_running_work_has_finished(cluster: Cluster, tmp_path: Path) -> None:
    srv = cluster.server()
    a = cluster.agent("n1")
    node_id = a.node_id()
    cluster.api.wait_node("n1", drain_phase="active", connected=True)
    # the task runs until the test lets it end (at most 120 s): a fixed sleep could end before a slow
    # machine had started the waiter and seen the node draining
    release = tmp_path / "release"
    hold = f"{held_until(release)}; echo done"
    tid = cluster.api.submit(command=["sh", "-c", hold])["id"]
    running_on(cluster, tid, "n1")

    env = base_env(PODIUM_ADDR=srv.api, PODIUM_TOKEN=srv.admin_token)
    waiter = subprocess.Popen([sys.executable, "-m", "podium", "drain", "n1", "--wait"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        # while the task runs the node is draining, not drained, and the waiter keeps waiting
        node = cluster.api.wait_node("n1", draining=True)
        assert node["drain_phase"] == "draining"
        listed = cli(srv.api, "nodes").stdout
        assert "draining" in listed, listed
        queued = cluster.api.submit(command=["true"])["id"]
        wait_for(lambda: cluster.api.task(queued)["reason"] == reasons.ALL_DRAINING, 30, what="the draining sentence")
        assert cluster.api.task(tid)["state"] == "running"
        assert waiter.poll() is None, "drain --wait returned while a task still ran on the node"
        release.touch()
        stdout, stderr = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()  # and close its pipes
    assert waiter.returncode == 0, stderr
    assert "drained" in stdout
    # the running work finished by itself: drained, not stopped
    assert cluster.api.task(tid)["state"] == "succeeded"
    assert cluster.api.http.get(f"/v1/nodes/{node_id}").json()["drain_phase"] == "drained"
    assert cluster.api.task(queued)["state"] == "queued"

    r = cli(srv.api, "undrain", "n1")
    assert r.returncode == 0, r.stderr
    assert cluster.api.http.get(f"/v1/nodes/{node_id}").json()["drain_phase"] == "active"
    assert cluster.api.wait_state(queued, "succeeded")["state"] == "succeeded"


def test_drain_deadline_applies_each_tasks_node_loss_policy(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("n1")
    node_id = a.node_id()
    requeue = cluster.api.submit(command=["sleep", "300"], requeue_on_node_loss=True, max_attempts=2)["id"]
    keep = cluster.api.submit(command=["sleep", "300"], requeue_on_node_loss=False)["id"]
    running_on(cluster, requeue, "n1")
    running_on(cluster, keep, "n1")

    r = cli(srv.api, "drain", "n1", "--deadline", "bogus")
    assert r.returncode != 0 and "--deadline" in r.stderr
    r = cli(srv.api, "drain", "n1", "--deadline", "2s")
    assert r.returncode == 0, r.stderr
    node = cluster.api.http.get(f"/v1/nodes/{node_id}").json()
    assert node["drain_phase"] == "draining" and node["drain_deadline"] is not None

    lost = cluster.api.wait_state(keep, ("lost", "succeeded", "failed", "cancelled"), 60)
    assert (lost["state"], lost["reason"]) == ("lost", reasons.DRAIN_DEADLINE)
    assert lost["attempt_list"][-1]["state"] == "lost"
    again = wait_for(lambda: (t := cluster.api.task(requeue))["state"] == "queued" and t, 60, what="the requeue")
    assert again["attempt_list"][0]["state"] == "lost"
    assert again["attempt_list"][0]["reason"] == reasons.DRAIN_DEADLINE
    # both went by a compare-and-set from `running`
    assert any(e["from_state"] == "running" and e["to_state"] == "queued" and e["reason"] == reasons.DRAIN_DEADLINE
               for e in again["events"])  # fmt: skip

    r = cli(srv.api, "drain", "n1", "--wait", timeout=60)
    assert r.returncode == 0, r.stderr
    assert cluster.api.http.get(f"/v1/nodes/{node_id}").json()["drain_phase"] == "drained"
    # the agent was told to stop both: every attempt it started has stopped
    def all_stopped() -> bool:
        entries = a.journal_entries()
        started = {e["token"] for e in entries if e["ev"] == "start"}
        return len(started) == 2 and started <= {e["token"] for e in entries if e["ev"] == "stop"}

    wait_for(all_stopped, 30, what="the agent to stop both attempts")
