"""Materialization snapshots with a real agent: the node's Hello carries one per backend, shown by
`podium nodes NODE` and the API's node view; an agent that comes back on another runtime (here the
test knob PODIUM_TEST_AGENT_RUNTIME, which the process backend's runtime digest includes) is told in
the node's history, naming both digests."""

from __future__ import annotations

from tests.acceptance.conftest import Cluster
from tests.harness import Agent, cli, wait_for


def test_a_node_reports_its_materializations_and_a_changed_runtime_is_told(cluster: Cluster) -> None:
    srv = cluster.server()
    first = cluster.agent("mat", extra_env={"PODIUM_TEST_AGENT_RUNTIME": "one"})
    node = cluster.api.wait_node("mat", connected=True)
    (m,) = node["materializations"]
    assert m["backend_kind"] == "process" and m["architecture"] == node["arch"]
    assert m["runtime_digest"].startswith("sha256:") and m["toolchain_digest"].startswith("sha256:") and m["digest"] == ""
    shown = cli(srv.api, "nodes", "mat")
    assert shown.returncode == 0, shown.stderr
    assert "materialization process" in shown.stdout and m["runtime_digest"] in shown.stdout
    assert "at most 4 tasks prepared" in shown.stdout

    first.stop()
    cluster.api.wait_node("mat", connected=False)
    again = Agent(cluster.tmp, [srv.grpc], "mat", extra_env={"PODIUM_TEST_AGENT_RUNTIME": "two"})
    cluster.agents.append(again)
    again.start()

    def changed() -> dict | None:
        n = cluster.api.wait_node("mat", connected=True)
        return n if n["materializations"][0]["runtime_digest"] != m["runtime_digest"] else None

    now = wait_for(changed, 30, what="the node's new runtime")
    new_digest = now["materializations"][0]["runtime_digest"]

    def told_events() -> list | None:
        events = cluster.api.http.get(f"/v1/nodes/{node['id']}/events").json()
        return [e for e in events if e["kind"] == "runtime_changed"] or None

    # written once the Hello that brought the new runtime is recorded (its own commit, just after)
    told = wait_for(told_events, 30, what="the runtime_changed event")
    assert len(told) == 1
    assert m["runtime_digest"] in told[0]["message"] and new_digest in told[0]["message"]
    assert told[0]["detail"]["changes"] == [{"backend_kind": "process", "from": m["runtime_digest"], "to": new_digest}]
