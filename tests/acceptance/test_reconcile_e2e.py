"""Reconcile claims with real replicas and a real agent on PostgreSQL 15: a replica SIGKILLed while it
holds reconcile claims loses them only at their expiry, and another replica then checks those attempts;
`podium show` tells the last check and its result. And an attempt whose node never comes back is
reconciled too: the loop says it waits for the node, then the node-loss policy takes it.

Replica A is started with PODIUM_TEST_RECONCILE_HOLD (it sits on every claim it takes, as a replica
stalled mid-claim would) and PODIUM_TEST_RECONCILE_CLAIM (claims long enough to outlast replica B's
start-up on a slow machine). Every assertion reads the database."""

from __future__ import annotations

import re
import signal

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.acceptance.test_replicas import sql, sql_val
from tests.harness import Api, Server, cli, wait_for

SERVER_ID = re.compile(r"Podium server (\S+): API on")
CLAIM_SECONDS = 20


def server_id(s: Server) -> str:
    return wait_for(lambda: (m := SERVER_ID.search(s.output())) and m.group(1), 30, what="the server to name itself")


def test_a_replica_killed_holding_reconcile_claims_loses_them_at_the_expiry(cluster: Cluster) -> None:
    db = cluster.db_url
    assert db is not None
    a = cluster.server(extra_env={"PODIUM_TEST_RECONCILE_HOLD": "3600", "PODIUM_TEST_RECONCILE_CLAIM": str(CLAIM_SECONDS)})
    b = Server(cluster.tmp, db, data_dir=cluster.tmp / "data-b")
    cluster.servers.append(b)  # stopped with the cluster; started below
    cluster.agent("r1", servers=[a, b])
    a_id = server_id(a)
    tids = [cluster.api.submit(command=["sleep", "300"], name=f"long-{i}")["id"] for i in range(2)]
    for tid in tids:
        cluster.api.wait_state(tid, "running")

    # replica A claims the attempts once they are due, and sits on its claims
    held = wait_for(lambda: sql(db, "SELECT task_id, reconcile_claim_expires_at, reconcile_claim_expires_at > now() AS live "
                                    "FROM attempts WHERE reconcile_owner = $1 AND finished_at IS NULL", a_id),
                    30, what="replica A to claim attempts")  # fmt: skip
    assert all(r["live"] for r in held)
    expiry = max(r["reconcile_claim_expires_at"] for r in held)
    claimed = [r["task_id"] for r in held]
    b.start()
    b_id = server_id(b)
    a.signal(signal.SIGKILL)

    # until the claims expire, nobody touches them: replica B runs and leaves them alone
    def expired() -> bool:
        rows = sql(db, "SELECT reconcile_owner, last_reconciled_at, now() AS now FROM attempts WHERE task_id = ANY($1)", claimed)
        if rows[0]["now"] >= expiry:
            return True
        assert all(r["reconcile_owner"] == a_id and r["last_reconciled_at"] is None for r in rows), rows
        return False

    assert sql_val(db, "SELECT now() < $1::timestamptz", expiry), "replica B took longer than the claim to start"
    wait_for(expired, CLAIM_SECONDS + 30, interval=0.2, what="replica A's claims to expire")

    # then replica B checks them; the agent failed over to B, so they are consistent with what it said
    def checked_by_b() -> list:
        rows = sql(db, "SELECT last_reconciled_by, last_reconciled_at, last_reconcile_result FROM attempts "
                       "WHERE task_id = ANY($1)", claimed)  # fmt: skip
        return rows if all(r["last_reconciled_by"] == b_id and r["last_reconcile_result"] == reasons.RECONCILED_CONSISTENT
                           for r in rows) else []  # fmt: skip

    rows = wait_for(checked_by_b, 60, what="replica B to reconcile replica A's attempts")
    assert all(r["last_reconciled_at"] >= expiry for r in rows)
    shown = cli(b.api, "show", str(claimed[0]))
    assert shown.returncode == 0, shown.stderr
    assert "last reconciled" in shown.stdout and b_id in shown.stdout
    assert reasons.RECONCILED_CONSISTENT in shown.stdout
    with Api(b.api) as api_b:
        for tid in tids:
            assert api_b.task(tid)["state"] == "running"
        last = api_b.task(str(claimed[0]))["attempt_list"][-1]
    assert last["last_reconciled_by"] == b_id and last["last_reconcile_result"] == reasons.RECONCILED_CONSISTENT


def test_an_attempt_whose_node_never_comes_back_is_reconciled(cluster: Cluster) -> None:
    db = cluster.db_url
    assert db is not None
    cluster.server()
    agent = cluster.agent("gone")
    tid = cluster.api.submit(command=["sleep", "300"], max_attempts=1)["id"]
    cluster.api.wait_state(tid, "running")
    agent.kill()  # SIGKILL: its fence keeper kills the task; the node never reconnects

    # its stream may close at once or only when the kernel gives up on it: either way the loop waits
    waiting = (reasons.RECONCILED_DISCONNECTED, reasons.RECONCILED_UNREACHABLE)
    wait_for(lambda: sql_val(db, "SELECT last_reconcile_result FROM attempts WHERE task_id = $1", tid) in waiting,
             30, what="the loop to say it waits for the node")  # fmt: skip
    task = cluster.api.wait_state(tid, "lost", timeout=60)
    assert task["reason"] == reasons.NODE_LOST
