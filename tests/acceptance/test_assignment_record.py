"""The assignment records what it was decided on (seed DurableAssignment), with a real agent: the
node's capabilities as placement saw them (kept after the node changes), the backend and its own
reference to what ran (the process group), the operation deadline and the retry count and limit —
in the API's task view and in `podium show`."""

from __future__ import annotations

from tests.acceptance.conftest import Cluster
from tests.harness import cli


def test_an_attempt_keeps_the_node_it_was_decided_on(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("rec", labels={"zone": "a"})
    tid = cluster.api.submit(command=["sleep", "60"], labels={"zone": "a"}, max_attempts=3)["id"]
    cluster.api.wait_state(tid, "running")
    node = cluster.api.wait_node("rec")
    # the operator relabels the node afterwards: the attempt still says what placement saw
    r = cluster.api.http.put(f"/v1/nodes/{node['id']}/labels", json={"labels": {"zone": "b"}})
    assert r.status_code == 200, r.text

    a = cluster.api.task(tid)["attempt_list"][0]
    snap = a["capability_snapshot"]
    assert snap["labels"] == {"zone": "a"} and snap["backends"] == ["process"] and snap["arch"] == node["arch"]
    assert snap["pool"] == "default" and snap["egress_contexts"] == node["egress_contexts"]
    assert a["backend_kind"] == "process" and a["backend_ref"] and int(a["backend_ref"]) > 1  # its process group
    assert a["operation_deadline"] == a["accept_deadline"]
    assert (a["retry_count"], a["retry_limit"]) == (0, 2)

    shown = cli(srv.api, "show", tid)
    assert shown.returncode == 0, shown.stderr
    assert f"attempt 1: decided on node {node['id']}: pool default" in shown.stdout
    assert "labels zone=a" in shown.stdout
    assert f"backend process ({a['backend_ref']})" in shown.stdout and "retry 0 of at most 2" in shown.stdout
    cluster.api.http.post(f"/v1/tasks/{tid}/cancel")
