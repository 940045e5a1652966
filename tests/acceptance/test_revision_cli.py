"""`podium cancel --if-revision N`: a stale revision is refused naming both, a current one cancels."""

from __future__ import annotations

from tests.acceptance.conftest import Cluster
from tests.harness import cli


def test_cancel_if_revision(cluster: Cluster) -> None:
    srv = cluster.server()
    task = cluster.api.submit(command=["true"])  # no agent: it stays queued, at revision 1
    assert task["revision"] == 1
    stale = cli(srv.api, "cancel", "--if-revision", "7", task["id"])
    assert stale.returncode != 0
    assert "revision 1" in stale.stderr and "revision 7" in stale.stderr
    assert cluster.api.task(task["id"])["state"] == "queued"
    ok = cli(srv.api, "cancel", "--if-revision", "1", task["id"])
    assert ok.returncode == 0, ok.stderr
    after = cluster.api.task(task["id"])
    assert (after["state"], after["revision"]) == ("cancelled", 2)
