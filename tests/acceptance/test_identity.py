"""One live agent per node identity (issue 11, parts 1 and 7): real server, real agent processes, real
PostgreSQL, fast timers. Two processes presenting one node's credential must never run one task twice
at once; the ground truth is what the commands themselves wrote, and what the agents journaled."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from podium import reasons
from podium.cli.main import EXIT_BUSY, EXIT_REFUSED, EXIT_SUPERSEDED
from podium.protocol import fence_after
from podium.timing import timing_from_env
from tests.acceptance.conftest import Cluster
from tests.harness import Agent, assert_at_most_one_attempt_at_once, base_env, cli, free_port, pid_alive, wait_for

T = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1"})
FENCE_AFTER = fence_after(T)  # what the server tells agents (Welcome.fence_after_seconds)
NOISE = ("Task was destroyed but it is pending", "aclose(): asynchronous generator is already running", "Traceback")


def ground_truth_command(gt: Path, seconds: float) -> list[str]:
    """A task that appends "<its shell's pid> <ns since the epoch>" to `gt` every 0.1s: what ran, and
    when, written by the run itself."""
    n = int(seconds / 0.1)
    return ["sh", "-c", f'for j in $(seq {n}); do echo $$ $(date +%s%N) >> "{gt}"; sleep 0.1; done']


def assert_runs_never_overlap(gt: Path) -> dict[str, tuple[float, float]]:
    spans: dict[str, tuple[float, float]] = {}
    for line in gt.read_text().splitlines():
        pid, ns = line.split()
        t = int(ns) / 1e9
        first, last = spans.get(pid, (t, t))
        spans[pid] = (min(first, t), max(last, t))
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for (p1, (_s1, e1)), (p2, (s2, _e2)) in zip(ordered, ordered[1:], strict=False):
        assert e1 < s2, f"run {p1} was still writing {e1 - s2:.3f}s after run {p2} started"
    return spans


def twin(cluster: Cluster, of: Agent, name: str, servers: list | None = None) -> Agent:
    """A second agent process presenting `of`'s node identity from a state directory of its own (a
    credential copied to another host): its own journal and log, the same node id and credential."""
    b = Agent(cluster.tmp, [s.grpc for s in (servers or cluster.servers)], name, extra_args=["--name", of.name])
    b.state_dir.mkdir(parents=True)
    for f in ("node-id", "credential"):
        shutil.copy2(of.state_dir / f, b.state_dir / f)
    cluster.agents.append(b)
    return b


def enrolled(a: Agent) -> str:
    node_id = a.node_id()
    wait_for(lambda: (a.state_dir / "credential").exists(), 30, what=f"agent {a.name} to be enrolled")
    return node_id


def running(cluster: Cluster, tid: str, token: int | None = None) -> dict:
    return wait_for(lambda: (t := cluster.api.task(tid))["state"] == "running" and (token is None or t["fencing_token"] == token) and t,
                    60, what=f"task {tid} running")  # fmt: skip


def journal(a: Agent, ev: str, token: int) -> list[dict]:
    return [e for e in a.journal_entries() if e["ev"] == ev and e["token"] == token]


def test_a_second_agent_on_the_same_state_dir_refuses_to_start(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("solo")
    enrolled(a)
    cluster.api.wait_node("solo", 30, connected=True)
    # the same state directory, hence the same node: it must not start (the later --state-dir wins)
    b = Agent(cluster.tmp, [cluster.servers[0].grpc], "solo-again", extra_args=["--state-dir", str(a.state_dir), "--name", "solo"])
    cluster.agents.append(b)
    b.start()
    assert b.p is not None
    code = b.p.wait(30)
    out = b.output()
    assert code == EXIT_BUSY, out
    assert f"pid {a.pid}" in out and "--state-dir" in out and str(a.state_dir) in out, out
    assert "Traceback" not in out
    # the first one never noticed: still the node's only agent, and it runs work
    assert a.alive()
    r = cli(cluster.servers[0].api, "run", "--", "sh", "-c", "echo still here")
    assert r.returncode == 0 and r.stdout == "still here\n", r.stderr
    assert a.alive() and len(cluster.api.nodes()) == 1


def test_a_copied_credential_supersedes_the_old_agent_which_kills_its_task_and_exits(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("twin")
    enrolled(a)
    gt = cluster.tmp / "GT"
    tid = cluster.api.submit(command=ground_truth_command(gt, 14))["id"]
    first = running(cluster, tid)
    wait_for(lambda: journal(a, "start", first["fencing_token"]), 30, what="the first run to start")

    b = twin(cluster, a, "twin-b")
    b.start()
    # the old instance is told, kills its attempt at once and exits saying by whom; it does not come back
    assert a.p is not None
    code = a.p.wait(30)
    assert code == EXIT_SUPERSEDED, a.output()
    assert "superseded by instance" in a.output()
    fenced = wait_for(lambda: journal(a, "fence", first["fencing_token"]), 10, what="the old instance to fence its attempt")
    superseded_at = fenced[0]["t"]
    pid = journal(a, "start", first["fencing_token"])[0]["pid"]
    wait_for(lambda: not pid_alive(pid), 10, what="the old attempt's process to be gone")

    # the server gives the attempt away only after the old instance's fence deadline: never on the
    # new instance's word alone (it cannot know what the old one still runs)
    def left_running() -> float | None:
        t = cluster.api.task(tid)
        return time.time() if not (t["state"] == "running" and t["fencing_token"] == first["fencing_token"]) else None

    given_up_at = wait_for(left_running, 60, interval=0.05, what="the first attempt to be given up")
    # The deadline is the old instance's last recorded heartbeat + its lease (+ a heartbeat): about
    # FENCE_AFTER after it was superseded on a quiet machine, less if its last heartbeats were
    # recorded late on a busy one. Half of it is still far from "at once" (today's bug).
    assert given_up_at - superseded_at >= FENCE_AFTER / 2, (
        f"the attempt was given away {given_up_at - superseded_at:.2f}s after the old instance was superseded"
    )
    done = cluster.api.wait_state(tid, ("succeeded", "failed", "lost"), 90)
    attempts = done["attempt_list"]
    assert attempts[0]["state"] == "lost" and attempts[0]["reason"] == reasons.INSTANCE_REPLACED, attempts
    assert done["state"] == "succeeded" and len(attempts) == 2, done

    # ground truth: the runs never overlapped, by the commands' own clock and by the agents' journals
    spans = assert_runs_never_overlap(gt)
    assert len(spans) == 2, spans
    assert_at_most_one_attempt_at_once([a, b])

    # the new instance holds the node and stays
    assert b.alive()
    node = cluster.api.wait_node("twin", 30, connected=True)
    assert node["instance_id"] and f"/{b.pid}/" in node["instance_id"], node
    # the node's history tells what happened, by the API and the CLI
    events = cluster.api.http.get(f"/v1/nodes/{node['id']}/events").json()
    sup = [e for e in events if e["kind"] == "superseded"]
    assert len(sup) == 1 and f"/{a.pid}/" in sup[0]["detail"]["old"] and f"/{b.pid}/" in sup[0]["detail"]["new"], events
    assert any(e["kind"] == "handover" and e["detail"]["task"] == tid for e in events), events
    r = cli(cluster.servers[0].api, "node-history", "twin")
    assert r.returncode == 0, r.stderr
    assert "superseded" in r.stdout and f"/{a.pid}/" in r.stdout and f"/{b.pid}/" in r.stdout, r.stdout
    for text in NOISE:
        assert text not in b.output(), b.output()


def test_the_old_agent_is_superseded_through_whichever_replica_holds_its_stream(cluster: Cluster) -> None:
    r1, r2 = cluster.server(), cluster.server()
    a = cluster.agent("split", servers=[r1])
    enrolled(a)
    gt = cluster.tmp / "GT"
    tid = cluster.api.submit(command=ground_truth_command(gt, 12))["id"]
    first = running(cluster, tid)
    wait_for(lambda: journal(a, "start", first["fencing_token"]), 30, what="the first run to start")
    b = twin(cluster, a, "split-b", servers=[r2])
    b.start()
    # r2 records the new instance; r1, which holds the old stream, hears of it and tells the old one
    assert a.p is not None
    assert a.p.wait(30) == EXIT_SUPERSEDED, a.output()
    assert journal(a, "fence", first["fencing_token"])[0]["why"] == "superseded"
    done = cluster.api.wait_state(tid, ("succeeded", "failed", "lost"), 90)
    assert_at_most_one_attempt_at_once([a, b])
    assert len(assert_runs_never_overlap(gt)) == 2
    assert done["state"] == "succeeded" and done["attempt_list"][0]["reason"] == reasons.INSTANCE_REPLACED, done
    assert b.alive() and cluster.api.wait_node("split", 30, connected=True)["instance_id"].split("/")[1] == str(b.pid)


def test_a_frozen_old_agent_is_fenced_by_its_deadline_before_its_task_runs_again(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("frozen")
    enrolled(a)
    gt = cluster.tmp / "GT"
    tid = cluster.api.submit(command=ground_truth_command(gt, 25))["id"]
    first = running(cluster, tid)
    wait_for(lambda: journal(a, "start", first["fencing_token"]), 30, what="the first run to start")
    # the old instance cannot hear that it was superseded: only its fence keeper stops its attempt
    a.signal(signal.SIGSTOP)
    try:
        b = twin(cluster, a, "frozen-b")
        b.start()
        cluster.api.wait_node("frozen", 30, connected=True, health="online")
        fenced = wait_for(lambda: journal(a, "fence", first["fencing_token"]), 60, what="the fence keeper to stop the attempt")
        assert fenced[0]["why"] == "lease expired"
        done = cluster.api.wait_state(tid, ("succeeded", "failed", "lost"), 90)
    finally:
        a.signal(signal.SIGCONT)
    # the second run started only after the first was fenced
    assert_at_most_one_attempt_at_once([a, b])
    assert len(assert_runs_never_overlap(gt)) == 2
    assert done["attempt_list"][0]["reason"] == reasons.INSTANCE_REPLACED, done
    assert done["state"] == "succeeded", done
    # woken, the old instance learns it was superseded (on its stream or when it says Hello again)
    # and leaves instead of taking the node back
    assert a.p is not None
    assert a.p.wait(30) == EXIT_SUPERSEDED, a.output()
    assert b.alive()
    time.sleep(T.heartbeat * 2)  # a ping-pong would show as the new one's stream closing
    assert cluster.api.wait_node("frozen", 30, connected=True)["instance_id"].split("/")[1] == str(b.pid)
    assert "superseded" not in b.output(), b.output()


def test_an_agent_the_server_refuses_exits_with_the_reason(cluster: Cluster) -> None:
    cluster.server()
    a = cluster.agent("nojoin", extra_env={"PODIUM_JOIN_TOKEN": ""})
    assert a.p is not None
    code = a.p.wait(30)
    assert code == EXIT_REFUSED, a.output()
    assert "a new node must present a join token" in a.output()
    assert "Traceback" not in a.output()


def test_agent_reconnects_to_a_restarted_server_without_asyncio_noise(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("steady")
    enrolled(a)
    cluster.api.wait_node("steady", 30, connected=True)
    for _ in range(2):
        srv.stop()
        srv.start()
        cluster.api.wait_node("steady", 60, connected=True)
        r = cli(srv.api, "run", "--", "sh", "-c", "echo after restart")
        assert r.returncode == 0 and r.stdout == "after restart\n", r.stderr
    assert a.alive()
    for text in NOISE:
        assert text not in a.output(), a.output()


# ---- podium dev ----------------------------------------------------------------------------------


def _dev(tmp: Path, data: Path, port: int, grpc_port: int) -> subprocess.Popen[bytes]:
    env = base_env(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "home" / ".config"))
    env.pop("PODIUM_DATABASE_URL", None)
    env.pop("XDG_RUNTIME_DIR", None)
    with open(tmp / f"dev-{port}.log", "ab") as log:  # the child has its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "podium", "dev", "--data-dir", str(data), "--port", str(port), "--grpc-port", str(grpc_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _dev_agent(dev: subprocess.Popen[bytes]) -> psutil.Process | None:
    try:
        return next((c for c in psutil.Process(dev.pid).children() if "agent" in c.cmdline()), None)
    except psutil.Error:
        return None


def _local_node_connected(tmp: Path, port: int) -> bool:
    with httpx.Client(timeout=2) as c:
        token = (tmp / "home" / ".config" / "podium" / "token").read_text().strip()
        nodes = c.get(f"http://127.0.0.1:{port}/v1/nodes", headers={"Authorization": f"Bearer {token}"}).json()
        return any(n["name"] == "local" and n["connected"] for n in nodes)


def _lock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _postmaster(data: Path) -> int | None:
    try:
        return int((data / "pg" / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def test_dev_killed_takes_its_agent_and_database_with_it_and_starts_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port, grpc_port = free_port(), free_port()
    first = _dev(tmp_path, data, port, grpc_port)
    second = third = None
    try:
        wait_for(lambda: _local_node_connected(tmp_path, port), 120, what="podium dev and its agent")
        agent = _dev_agent(first)
        postmaster = _postmaster(data)
        assert agent is not None and postmaster is not None and pid_alive(postmaster)

        # a second `podium dev` on the same data directory refuses, saying why, and disturbs nothing
        second = _dev(tmp_path, data, free_port(), free_port())
        assert second.wait(60) == EXIT_BUSY
        text = (tmp_path / f"dev-{second.args[-3]}.log").read_text()
        assert f"in use by another `podium dev` (pid {first.pid})" in text and "Traceback" not in text, text
        assert first.poll() is None and agent.is_running()

        first.kill()  # SIGKILL: no chance to clean up itself
        first.wait(10)
        wait_for(lambda: not pid_alive(agent.pid), 60, what="the agent to die with podium dev")
        wait_for(lambda: not pid_alive(postmaster), 60, what="the embedded PostgreSQL to stop with podium dev")
        # the next `podium dev` on that data directory starts cleanly (once the guard, which cleans
        # up after the killed one, has let go of the directory)
        wait_for(lambda: _lock_free(data / "dev.lock"), 60, what="the killed podium dev's guard to finish")
        third = _dev(tmp_path, data, port, grpc_port)
        wait_for(lambda: _local_node_connected(tmp_path, port), 120, what="the next podium dev and its agent")
        assert third.poll() is None
        r = subprocess.run([sys.executable, "-m", "podium", "run", "--", "sh", "-c", "echo again"],
                           env=base_env(PODIUM_ADDR=f"http://127.0.0.1:{port}", HOME=str(tmp_path / "home"),
                                        XDG_CONFIG_HOME=str(tmp_path / "home" / ".config")),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0 and r.stdout == "again\n", r.stderr
    except AssertionError as e:
        logs = "\n".join(f"==== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(tmp_path.glob("dev-*.log")))
        raise AssertionError(f"{e}\n{logs}") from None
    finally:
        for p in (first, second, third):
            if p is not None:
                _stop(p)
    # a clean stop leaves nothing behind either
    wait_for(lambda: _postmaster(data) is None or not pid_alive(_postmaster(data) or 0), 60, what="PostgreSQL to stop")
    assert os.path.exists(data / "pg" / "PG_VERSION")
