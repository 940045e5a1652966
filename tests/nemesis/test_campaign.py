"""A short nemesis campaign on every run of the suite: a fleet of three agent hosts in network
namespaces and two replicas with mutual TLS, 25 seconds of random faults under a workload, then the
checker. It passes only with zero anomalies, and it shows the checker is not blind: given forged
ground truth (a second attempt alive at the same time, a success the node never saw) it reports it.

Select it with `-m nemesis`. PODIUM_NEMESIS_SEED replays another schedule of faults.
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.nemesis.campaign import run
from tests.nemesis.checker import check
from tests.nemesis.fleet import Fleet
from tests.nemesis.net import PREFIX, sh
from tests.nemesis.workload import Record

pytestmark = [
    pytest.mark.nemesis,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None,
                       reason="a nemesis fleet needs root, ip and iptables (network namespaces)"),  # fmt: skip
]

SEED = int(os.environ.get("PODIUM_NEMESIS_SEED", "20261556"))


def test_short_campaign_finds_no_anomaly(tmp_path: Path) -> None:
    forged: dict[str, Any] = {}

    def probe(fleet: Fleet, rec: Record, truth: dict[str, list[dict[str, Any]]]) -> None:
        async def judge(t: dict[str, list[dict[str, Any]]]) -> list[str]:
            conn = await fleet.connect_db()
            try:
                return [k for k, _ in (await check(conn, rec, t)).anomalies]
            finally:
                await conn.close()

        succeeded = asyncio.run(_succeeded_with_one_run(fleet, truth))
        assert succeeded, "no task succeeded on its first run: the campaign did no useful work"
        tid = succeeded[0]
        # a second attempt of a task alive while its first one ran, as a double assignment would show
        twice = copy.deepcopy(truth)
        a = dict(twice[tid][0])
        a.update(token=a["token"] + 10**9, start=(a["start"] + a["last"]) / 2)
        twice[tid].append(a)
        forged["overlap"] = asyncio.run(judge(twice))
        # the node saw exit 3 where the store says succeeded
        failed = copy.deepcopy(truth)
        failed[tid][0]["end_code"] = 3
        forged["exit"] = asyncio.run(judge(failed))
        forged["ns"] = [ln for ln in sh("ip", "netns", "list").stdout.splitlines() if ln.startswith(f"{PREFIX}-{os.getpid()}-")]

    # faults come twice as often as in a long run: 25 seconds should see most kinds
    res = run(25, SEED, hosts=3, rate=3.0, settle_timeout=45, root=tmp_path / "run", probe=probe, fault_interval=(0.5, 2.0))
    assert res.report.splitlines()[-1] == f"anomalies: {res.anomalies}"
    assert res.anomalies == 0, res.report
    assert sum(res.faults.values()) >= 4 and len(res.faults) >= 3, res.report
    assert res.ops["submit"] + res.ops["submit (keyed)"] >= 20, res.report
    assert res.verdict.attempts_run >= 10, res.report
    # the checker is not blind
    assert "concurrent-attempts" in forged["overlap"] and "stale-token-ran" not in forged["overlap"]
    assert forged["exit"] == ["succeeded-untrue"]
    # the fleet really was in namespaces, and nothing of it is left behind
    assert len(forged["ns"]) == 3
    assert not [ln for ln in sh("ip", "netns", "list").stdout.splitlines() if ln.startswith(f"{PREFIX}-{os.getpid()}-")]
    assert f"{PREFIX}{os.getpid()}b" not in sh("ip", "-o", "link", "show").stdout


async def _succeeded_with_one_run(fleet: Fleet, truth: dict[str, list[dict[str, Any]]]) -> list[str]:
    conn = await fleet.connect_db()
    try:
        rows = await conn.fetch("SELECT id::text FROM tasks WHERE state = 'succeeded'")
    finally:
        await conn.close()
    return [r["id"] for r in rows if len(truth.get(r["id"], [])) == 1]
