"""A task's output comes back byte for byte in the order it was written: through the API and the CLI,
for large outputs, across a server killed mid-output, with each chunk's byte offset to resume from."""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.acceptance.conftest import Cluster
from tests.harness import ADMIN_TOKENS, Api, Server, base_env, cli, wait_for

TERMINAL = ("succeeded", "failed", "cancelled", "lost")


def chunks(api: Api, tid: str, **params: Any) -> list[dict[str, Any]]:
    """Every chunk of a task's output, page by page, each with its bytes under "raw"."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        q = {"encoding": "base64", "limit": 200, **params, **({"cursor": cursor} if cursor else {})}
        r = api.http.get(f"/v1/tasks/{tid}/logs", params=q)
        assert r.status_code == 200, r.text
        page = r.json()
        if not page["chunks"]:
            return out
        for c in page["chunks"]:
            c["raw"] = base64.b64decode(c["data"])
            out.append(c)
        cursor = page["next_cursor"]


def text_via_after(api: Api, tid: str) -> str:
    """The output as a client of the first API version reads it: UTF-8 pages, `after` the last id."""
    text, after = "", 0
    while True:
        page = api.http.get(f"/v1/tasks/{tid}/logs", params={"after": after, "limit": 3}).json()
        if not page["chunks"]:
            return text
        text += "".join(c["data"] for c in page["chunks"])
        after = page["next_after"]


def cli_bytes(addr: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    env = base_env(PODIUM_ADDR=addr, PODIUM_TOKEN=ADMIN_TOKENS[addr])
    return subprocess.run([sys.executable, "-m", "podium", *args], env=env, capture_output=True, timeout=timeout)


def assert_offsets_add_up(cs: list[dict[str, Any]]) -> None:
    """Per attempt and stream, each chunk starts where the one before it ended; no seq twice."""
    ends: dict[tuple[int, str], int] = {}
    seqs: set[tuple[int, int]] = set()
    for c in cs:
        key = (c["attempt"], c["stream"])
        assert c["offset"] == ends.get(key, 0), (c["offset"], ends.get(key, 0), key)
        assert c["length"] == len(c["raw"])
        ends[key] = c["offset"] + c["length"]
        assert (c["attempt"], c["seq"]) not in seqs
        seqs.add((c["attempt"], c["seq"]))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


LOOP = "for i in $(seq 1 20); do echo line$i; sleep 0.01; done"


def test_a_sleep_loop_comes_back_in_order_through_run_logs_and_the_api(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("a1")
    expected = "".join(f"line{i}\n" for i in range(1, 21))
    r = cli(srv.api, "run", "--", "sh", "-c", LOOP)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected
    tid = json.loads(cli(srv.api, "ls", "--json").stdout)[0]["id"]
    assert cli(srv.api, "logs", tid).stdout == expected
    assert cli(srv.api, "logs", "-f", tid).stdout == expected
    assert text_via_after(cluster.api, tid) == expected  # the first version's paging still works
    cs = chunks(cluster.api, tid)
    assert b"".join(c["raw"] for c in cs) == expected.encode()
    assert_offsets_add_up(cs)


def test_large_outputs_come_back_byte_for_byte(cluster: Cluster, tmp_path: Path) -> None:
    srv = cluster.server()
    cluster.agent("a1")
    numbers = cluster.api.submit(command=["seq", "200000"])["id"]
    noise_file = tmp_path / "noise.b64"
    noise = cluster.api.submit(command=["sh", "-c", f"head -c 5000000 /dev/urandom | base64 | tee {noise_file}"])["id"]
    for tid in (numbers, noise):
        assert cluster.api.wait_state(tid, TERMINAL, 120)["state"] == "succeeded"

    expected = "".join(f"{i}\n" for i in range(1, 200001)).encode()
    cs = chunks(cluster.api, numbers)
    assert sha(b"".join(c["raw"] for c in cs)) == sha(expected)
    assert_offsets_add_up(cs)
    assert sha(cli_bytes(srv.api, "logs", numbers).stdout) == sha(expected)

    written = noise_file.read_bytes()
    assert len(written) > 6_000_000
    cs = chunks(cluster.api, noise)
    assert sha(b"".join(c["raw"] for c in cs)) == sha(written)
    assert_offsets_add_up(cs)
    assert sha(text_via_after(cluster.api, noise).encode()) == sha(written)


def test_bytes_that_are_not_utf8_come_back_exactly(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("a1")
    # a euro sign split across two writes (two chunks), and a byte that is no UTF-8 at all
    script = r"printf '\342\202'; sleep 0.3; printf '\254 ok\n'; printf '\377\n' >&2"
    tid = cluster.api.submit(command=["sh", "-c", script])["id"]
    assert cluster.api.wait_state(tid, TERMINAL, 60)["state"] == "succeeded"
    cs = chunks(cluster.api, tid)
    assert b"".join(c["raw"] for c in cs if c["stream"] == "stdout") == "€ ok\n".encode()
    assert b"".join(c["raw"] for c in cs if c["stream"] == "stderr") == b"\xff\n"
    shown = cli_bytes(srv.api, "logs", tid)
    assert (shown.stdout, shown.stderr) == ("€ ok\n".encode(), b"\xff\n")


def test_offsets_let_a_client_resume_exactly(cluster: Cluster) -> None:
    cluster.server()
    cluster.agent("a1")
    script = "for i in $(seq 1 40); do echo out$i; echo err$i >&2; sleep 0.01; done"
    tid = cluster.api.submit(command=["sh", "-c", script])["id"]
    assert cluster.api.wait_state(tid, TERMINAL, 60)["state"] == "succeeded"
    cs = chunks(cluster.api, tid)
    assert_offsets_add_up(cs)
    out = b"".join(c["raw"] for c in cs if c["stream"] == "stdout")
    err = b"".join(c["raw"] for c in cs if c["stream"] == "stderr")
    assert out == "".join(f"out{i}\n" for i in range(1, 41)).encode()
    assert err == "".join(f"err{i}\n" for i in range(1, 41)).encode()
    assert [c["seq"] for c in cs] == list(range(len(cs)))  # one sequence over both streams, no gaps

    # resuming a stream at any byte, also inside a chunk, returns exactly the rest of it
    for n in (0, 1, len(out) // 2 + 1, len(out) - 1, len(out)):
        rest = chunks(cluster.api, tid, stream="stdout", offset=n)
        assert b"".join(c["raw"] for c in rest) == out[n:]
        assert all(c["stream"] == "stdout" for c in rest)
        if rest:
            assert rest[0]["offset"] == n
    # a cursor from any chunk resumes right after it
    for i in (0, len(cs) // 2, len(cs) - 1):
        after = chunks(cluster.api, tid, cursor=cs[i]["cursor"])
        assert [c["seq"] for c in after] == [c["seq"] for c in cs[i + 1 :]]
    # bad resume points are refused, naming what is wrong
    for bad, word in (({"offset": 3}, "stream"), ({"cursor": "nonsense"}, "cursor"), ({"stream": "stdin"}, "stream"),
                      ({"after": 10**12}, "after")):  # fmt: skip
        r = cluster.api.http.get(f"/v1/tasks/{tid}/logs", params=bad)
        assert r.status_code == 422 and word in r.json()["error"], (bad, r.text)


# The server is down while the task writes, then starts again, and the agent must reconnect before
# its fence (two heartbeats short of OfflineAfter, from its last acknowledged heartbeat) kills the
# task: 6.5-10 s with tenfold timers, which a slow machine's writes, start and reconnect can use up.
# Timers three times faster in every process of these tests: the fence is 21 s or more into it.
GENTLER = {"PODIUM_TEST_TIMER_DIVISOR": "3"}


def kill_and_restart_while_writing(cluster: Cluster, srv: Server, written: Path) -> Server:
    """SIGKILL the server while a task writes to `written`; once it has written more with no server
    to send it to (the agent keeps it and sends it again to the next server), start it again."""
    srv.signal(signal.SIGKILL)
    srv.p.wait(10)  # type: ignore[union-attr]
    at_kill = written.stat().st_size
    wait_for(lambda: written.stat().st_size > at_kill + 2000, 60, what="output written while the server is down")
    return cluster.server(port=srv.port, grpc_port=srv.grpc_port, extra_env=GENTLER)


def test_output_survives_a_server_killed_mid_output(cluster: Cluster, tmp_path: Path) -> None:
    srv = cluster.server(extra_env=GENTLER)
    cluster.agent("a1", extra_env=GENTLER)
    stop, written = tmp_path / "stop", tmp_path / "written"
    # it writes until told to stop (so output is written while the server is down), then a burst;
    # `tee` keeps what it wrote, to compare with what was stored
    script = (f"( i=0; while [ ! -e {stop} ]; do i=$((i+1)); echo before $i; sleep 0.005; done; "
              f"seq 1 30000 | sed 's/^/after /' ) | tee {written}")  # fmt: skip
    tid = cluster.api.submit(command=["sh", "-c", script])["id"]
    cluster.api.wait_state(tid, "running", 60)
    follower = subprocess.Popen(
        [sys.executable, "-m", "podium", "logs", "-f", tid], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=base_env(PODIUM_ADDR=srv.api, PODIUM_TOKEN=ADMIN_TOKENS[srv.api]),
    )  # fmt: skip
    try:
        wait_for(lambda: len(chunks(cluster.api, tid)) >= 5, 60, what="some output stored")
        srv2 = kill_and_restart_while_writing(cluster, srv, written)
        wait_for(lambda: len(chunks(cluster.api, tid)) > 0, 60, what="the restarted server")
        stop.touch()
        assert cluster.api.wait_state(tid, TERMINAL, 120)["state"] == "succeeded"
        followed, ferr = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    expected = written.read_bytes()
    assert expected.endswith(b"after 30000\n")
    cs = chunks(cluster.api, tid)
    assert sha(b"".join(c["raw"] for c in cs)) == sha(expected)
    assert_offsets_add_up(cs)
    assert sha(cli_bytes(srv2.api, "logs", tid).stdout) == sha(expected)
    # the follower lost its server and resumed where it was: nothing twice, nothing missing
    assert follower.returncode == 0, ferr
    assert sha(followed) == sha(expected)


def test_podium_run_survives_a_server_restart_mid_output(cluster: Cluster, tmp_path: Path) -> None:
    """`podium run` follows the server's log stream; killed and restarted under it, the stream is
    resumed after the last chunk it printed: the bytes exact, none twice, and the task's exit code."""
    srv = cluster.server(extra_env=GENTLER)
    cluster.agent("a1", extra_env=GENTLER)
    stop, written = tmp_path / "stop", tmp_path / "written"
    script = (f"( i=0; while [ ! -e {stop} ]; do i=$((i+1)); echo before $i; sleep 0.005; done; "
              f"seq 1 20000 | sed 's/^/after /'; printf '\\377\\376 no newline' ) | tee {written}; exit 7")  # fmt: skip
    runner = subprocess.Popen(
        [sys.executable, "-m", "podium", "run", "--name", "restarted", "--", "sh", "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=base_env(PODIUM_ADDR=srv.api, PODIUM_TOKEN=ADMIN_TOKENS[srv.api]),
    )  # fmt: skip
    try:
        wait_for(lambda: written.exists() and written.stat().st_size > 2000, 60, what="the task writing output")
        kill_and_restart_while_writing(cluster, srv, written)
        tid = wait_for(lambda: next(iter(cluster.api.http.get("/v1/tasks", params={"name": "restarted"}).json()), None), 60,
                       what="the restarted server")  # fmt: skip
        stop.touch()
        assert cluster.api.wait_state(tid["id"], TERMINAL, 120)["exit_code"] == 7
        followed, ferr = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    expected = written.read_bytes()
    assert expected.endswith(b"after 20000\n\xff\xfe no newline")
    assert runner.returncode == 7, ferr
    assert sha(followed) == sha(expected), (len(followed), len(expected))
