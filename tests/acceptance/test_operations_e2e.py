"""Capacity operations (seed Capacity.Operations) with a real agent: a node that prepares at most two
tasks at once (`podium agent --max-operations 2`) is given a burst of eight it has slots for, and
never holds more than two attempts that are assigned or provisioning; the tasks waiting meanwhile are
told why. Each attempt's provisioning is slowed (PODIUM_TEST_AGENT_PROVISION_DELAY) so the limit is
reached on any machine. Every observation is one consistent read of the database."""

from __future__ import annotations

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.acceptance.test_replicas import sql
from tests.harness import wait_for

LIMIT = 2
BURST = 8


def test_a_burst_never_exceeds_the_nodes_operations_limit(cluster: Cluster) -> None:
    db = cluster.db_url
    assert db is not None
    cluster.server()
    cluster.agent("ops", slots=BURST, extra_args=["--max-operations", str(LIMIT)],
                  extra_env={"PODIUM_TEST_AGENT_PROVISION_DELAY": "1.0"})  # fmt: skip
    node = cluster.api.wait_node("ops")
    assert node["max_operations"] == LIMIT
    tids = [r["task"]["id"] for r in cluster.api.http.post("/v1/tasks/batch", json={"tasks": [
        {"command": ["true"], "name": f"burst-{i}"} for i in range(BURST)]}).json()]  # fmt: skip
    assert len(tids) == BURST

    peak = 0
    told = False

    def done() -> bool:
        nonlocal peak, told
        # one statement, one snapshot: the operations held and every task's state at one instant
        rows = sql(db, """SELECT (SELECT count(*) FROM attempts WHERE node_id = $1 AND finished_at IS NULL
                                   AND state IN ('assigned', 'provisioning')) AS ops,
                                 (SELECT count(*) FROM tasks WHERE state = 'queued' AND reason = $2) AS told,
                                 (SELECT count(*) FROM tasks WHERE state = 'succeeded') AS ok""",
                   node["id"], reasons.OPERATIONS_BUSY)  # fmt: skip
        ops, waiting, ok = rows[0]["ops"], rows[0]["told"], rows[0]["ok"]
        assert ops <= LIMIT, f"{ops} provisioning operations at once on a node that allows {LIMIT}"
        peak = max(peak, ops)
        told = told or waiting > 0
        return ok == BURST

    wait_for(done, 120, interval=0.05, what="the burst to finish")
    assert peak == LIMIT  # the limit was reached (and never passed)
    assert told, "no waiting task was told the operations reason"
