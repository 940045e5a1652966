"""`podium bench` against a real server and a real agent: it runs what it says, waits for every task,
and its figures are the ones the API and the tasks themselves give."""

from __future__ import annotations

import json
import time

import pytest

from tests.acceptance.conftest import Cluster
from tests.harness import cli

pytestmark = pytest.mark.slow


def test_bench_runs_a_burst_and_one_at_a_time(cluster: Cluster) -> None:
    server = cluster.server()
    cluster.agent("n1", slots=4)
    cluster.api.wait_node("n1", connected=True)
    before = time.time()
    r = cli(server.api, "bench", "--tasks", "12", "--batch", "5", "--serial", "3", "--warmup", "2", "--json", timeout=300)
    after = time.time()
    assert r.returncode == 0, r.stderr
    burst, serial = (json.loads(line) for line in r.stdout.splitlines())

    assert burst["mode"] == "burst" and burst["tasks"] == 12 and burst["ends"] == {"succeeded": 12}
    assert burst["stream_lost"] is None  # every time came from the event stream, none from a poll
    assert burst["submit_to_running_ms"]["n"] == 12 and burst["submit_to_succeeded_ms"]["n"] == 12
    assert 0 < burst["submit_to_running_ms"]["p50"] <= burst["submit_to_succeeded_ms"]["p99"]
    # the rate is the count over the unrounded seconds: within what rounding those to 1 ms allows
    secs = burst["seconds"]
    assert 0 < secs <= after - before and 12 / (secs + 0.0005) - 0.05 <= burst["tasks_per_s"] <= 12 / max(secs - 0.0005, 1e-9) + 0.05
    # its two parts: the first end, and the other eleven over the time from it to the last end
    first_end = burst["first_end_ms"] / 1000
    assert 0 < first_end <= secs + 0.0005
    if burst["after_first_end_per_s"] is not None:
        flowing = max(secs - first_end, 1e-9)
        assert 11 / (flowing + 0.001) - 0.05 <= burst["after_first_end_per_s"] <= 11 / max(flowing - 0.001, 1e-9) + 0.05
    else:
        assert secs - first_end < 0.001  # all twelve ended in the same instant
    # the longest of the eleven pauses between two ends: no longer than their sum, no shorter than their mean
    pause = burst["longest_pause_ms"] / 1000
    assert (secs - first_end) / 11 - 0.001 <= pause <= secs - first_end + 0.001

    assert serial["mode"] == "serial" and serial["ends"] == {"succeeded": 3}
    assert serial["command"] == ["date", "+%s.%N"]
    first = serial["submit_to_first_instruction_ms"]
    # the task wrote its own start time: after the submit, before the API said it succeeded
    assert first["n"] == 3 and 0 < first["p50"] <= serial["submit_to_succeeded_ms"]["p99"]

    # every task it ran is there to see, named as the bench names them: warm-up 2, burst 12, serial 3
    tasks = cluster.api.http.get("/v1/tasks", params={"limit": 100}).json()
    assert sum(t["name"] == "podium-bench" for t in tasks) == 17


def test_bench_with_a_command_and_bad_input(cluster: Cluster) -> None:
    server = cluster.server()
    cluster.agent("n1", slots=2)
    cluster.api.wait_node("n1", connected=True)
    r = cli(server.api, "bench", "--tasks", "3", "--warmup", "0", "--command", "sh -c 'exit 3'", "--json")
    assert r.returncode == 0, r.stderr
    (burst,) = (json.loads(line) for line in r.stdout.splitlines())
    assert burst["command"] == ["sh", "-c", "exit 3"] and burst["ends"] == {"failed": 3}
    assert burst["submit_to_succeeded_ms"]["n"] == 0

    nothing = cli(server.api, "bench", "--tasks", "0")
    assert nothing.returncode == 1 and "nothing to run" in nothing.stderr and "Traceback" not in nothing.stderr
    unsplit = cli(server.api, "bench", "--command", "sh -c 'oops")
    assert unsplit.returncode == 1 and "cannot be split" in unsplit.stderr
