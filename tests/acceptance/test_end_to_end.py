"""The whole path from submit to exit code, with a real server, real agents and the real CLI."""

from __future__ import annotations

import json
import signal
import socket

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.harness import cli, pid_alive, wait_for


def test_run_streams_output_and_exits_with_the_task_code(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("a1")
    r = cli(srv.api, "run", "--", "sh", "-c", "echo hi; echo oops >&2; exit 3")
    assert r.returncode == 3, r.stderr
    assert r.stdout == "hi\n"
    assert "oops" in r.stderr and "failed" in r.stderr and "exit code 3" in r.stderr
    listed = json.loads(cli(srv.api, "ls", "--json").stdout)
    assert [(t["state"], t["exit_code"]) for t in listed] == [("failed", 3)]

    ok = cli(srv.api, "run", "--", "sh", "-c", "echo fine")
    assert ok.returncode == 0 and ok.stdout == "fine\n"
    shown = json.loads(cli(srv.api, "show", "--json", json.loads(cli(srv.api, "ls", "--json").stdout)[0]["id"]).stdout)
    assert shown["state"] == "succeeded" and shown["exit_code"] == 0
    assert [e["to_state"] for e in shown["events"]] == ["queued", "assigned", "provisioning", "running", "succeeded"]
    assert shown["attempt_list"][0]["state"] == "exited"
    # the node's capacity is all given back
    node = cluster.api.nodes()[0]
    assert node["reserved"]["slots"] == 0 and node["reserved"]["cpu_millis"] == 0


def test_queued_with_no_node_says_why_and_starts_when_an_agent_connects(cluster: Cluster) -> None:
    srv = cluster.server()
    tid = cli(srv.api, "run", "--detach", "--", "echo", "finally").stdout.strip()
    wait_for(lambda: cluster.api.task(tid)["reason"] == reasons.NO_NODES, 30, what="the no-node reason")
    shown = cli(srv.api, "show", tid).stdout
    assert "queued" in shown and reasons.NO_NODES in " ".join(shown.split())
    assert cluster.api.task(tid)["state"] == "queued"
    cluster.agent("late")
    t = cluster.api.wait_state(tid, "succeeded", 60)
    assert t["exit_code"] == 0
    assert cli(srv.api, "logs", tid).stdout == "finally\n"


def test_cancel_of_a_running_task_ends_its_process(cluster: Cluster) -> None:
    srv = cluster.server()
    agent = cluster.agent("a1")
    tid = cli(srv.api, "run", "--detach", "--", "sleep", "600").stdout.strip()
    cluster.api.wait_state(tid, "running", 60)
    starts = wait_for(lambda: [e for e in agent.journal_entries() if e["ev"] == "start"], 30, what="the journal")
    pid = starts[0]["pid"]
    assert pid_alive(pid)
    r = cli(srv.api, "cancel", tid)
    assert r.returncode == 0, r.stderr
    t = cluster.api.wait_state(tid, "cancelled", 60)
    assert t["reason"] == reasons.CANCELLED
    wait_for(lambda: not pid_alive(pid), 30, what="the sleep process to be gone")
    assert [e["to_state"] for e in t["events"]][-2:] == ["cancelling", "cancelled"]


def test_cancel_of_a_queued_task_is_immediate(cluster: Cluster) -> None:
    srv = cluster.server()
    tid = cli(srv.api, "run", "--detach", "--", "true").stdout.strip()
    r = cli(srv.api, "cancel", "--json", tid)
    assert json.loads(r.stdout)["state"] == "cancelled"


def test_idempotency_key_returns_the_same_task(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cli(srv.api, "run", "--detach", "--idempotency-key", "deploy-42", "--", "true").stdout.strip()
    b = cli(srv.api, "run", "--detach", "--idempotency-key", "deploy-42", "--", "true").stdout.strip()
    assert a and a == b
    assert len(json.loads(cli(srv.api, "ls", "--json").stdout)) == 1
    clash = cli(srv.api, "run", "--detach", "--idempotency-key", "deploy-42", "--", "false")
    assert clash.returncode == 1 and "different spec" in clash.stderr


def test_restarting_the_server_mid_task_loses_nothing(cluster: Cluster) -> None:
    srv = cluster.server()
    agent = cluster.agent("a1")
    tid = cli(srv.api, "run", "--detach", "--", "sh", "-c", "echo before; sleep 4; echo after; exit 7").stdout.strip()
    cluster.api.wait_state(tid, "running", 60)
    srv.signal(signal.SIGKILL)
    srv.p.wait(10)  # type: ignore[union-attr]
    # the condition the restart needs, rather than a sleep that a busy machine may outlast
    wait_for(lambda: _bindable(srv.port) and _bindable(srv.grpc_port), 30, what="the dead server's ports to be free")
    srv2 = cluster.server(port=srv.port, grpc_port=srv.grpc_port)
    t = cluster.api.wait_state(tid, ("succeeded", "failed", "lost", "cancelled"), 90)
    assert (t["state"], t["exit_code"]) == ("failed", 7), t
    assert len(t["attempt_list"]) == 1  # no second attempt: the first one's end was kept
    assert cli(srv2.api, "logs", tid).stdout == "before\nafter\n"
    starts = [e for e in agent.journal_entries() if e["ev"] == "start"]
    assert len(starts) == 1


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's listeners do
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_bad_input_gets_one_clear_line(cluster: Cluster) -> None:
    srv = cluster.server()
    r = cli(srv.api, "run", "--memory", "12XB", "--", "true")
    assert r.returncode != 0 and "unknown unit" in r.stderr and "Traceback" not in r.stderr
    r = cli(srv.api, "show", "not-a-task")
    assert r.returncode == 1 and "not a task id" in r.stderr and "Traceback" not in r.stderr
    r = cli("http://127.0.0.1:1", "ls")
    assert r.returncode == 1 and "cannot reach" in r.stderr
    assert cli(srv.api, "ls", "--json").stdout.strip() == "[]"


def test_batch_submit_is_one_transaction_and_idempotent(cluster: Cluster) -> None:
    cluster.server()
    cluster.agent("a1", slots=8)
    api = cluster.api
    body = {"tasks": [{"command": ["echo", str(i)], "idempotency_key": f"b-{i}"} for i in range(20)]}
    first = api.http.post("/v1/tasks/batch", json=body)
    assert first.status_code == 200, first.text
    again = api.http.post("/v1/tasks/batch", json=body).json()
    assert [x["created"] for x in again] == [False] * 20
    assert [x["task"]["id"] for x in again] == [x["task"]["id"] for x in first.json()]
    for x in first.json():
        api.wait_state(x["task"]["id"], "succeeded", 60)
    bad = api.http.post("/v1/tasks/batch", json={"tasks": [{"command": ["true"]}, {"command": []}]})
    assert bad.status_code == 422 and "tasks.1" in bad.json()["error"]
    assert len(api.http.get("/v1/tasks", params={"limit": 1000}).json()) == 20


def test_the_server_reports_its_work_in_prometheus_metrics(cluster: Cluster) -> None:
    """/metrics counts what the server did: each placement, and each node report it applied (a
    task's provisioning, running and exit), and shows nothing left waiting."""
    from prometheus_client.parser import text_string_to_metric_families

    cluster.server()
    cluster.agent("a1", slots=8)
    api = cluster.api
    first = api.http.post("/v1/tasks/batch", json={"tasks": [{"command": ["true"]}] * 12})
    assert first.status_code == 200, first.text
    for x in first.json():
        api.wait_state(x["task"]["id"], "succeeded", 60)

    def scrape() -> dict[str, float]:
        r = api.http.get("/metrics")
        assert r.status_code == 200, r.text
        return {
            s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples
        }  # fmt: skip

    # the Ack of an end goes out right after its commit; the counter follows within the same batch
    wait_for(lambda: scrape().get("podium_node_reports_total{outcome=applied}") == 36, 30, what="36 applied reports")
    m = scrape()
    assert m["podium_placements_total"] == 12
    assert m["podium_node_report_batch_size_sum"] == 36  # every applied report went through a group commit
    assert 1 <= m["podium_node_report_batch_size_count"] <= 36
    assert m["podium_node_report_backlog"] == 0
    assert m["podium_connected_nodes"] == 1
    assert m.get("podium_node_reports_total{outcome=rejected}", 0) == 0
    assert m["podium_event_loop_lag_seconds_count"] >= 1
