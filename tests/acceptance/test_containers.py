"""Containers end to end: a real server, real agents started as `podium agent --backend container
--container-host …` against the suite's real engine (tests/engine.py: podman's Docker-compatible
service), images pushed to the suite's real registry (tests/registry.py: docker-registry with
htpasswd), and the real CLI.

Each image prints what it is (`/etc/podium-image`, a note baked into it), so a test can tell which
image ran: that is how "a retry runs the digest the tag had, not what the tag points at now" is
checked. Nothing here stands in for the engine, the registry or the agent.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import docker.errors
import pytest

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.engine import Engine, running_engine
from tests.harness import Agent, Api, Server, assert_at_most_one_attempt_at_once, base_env, cli, free_port, wait_for
from tests.registry import RegistryServer, busybox_image

pytestmark = pytest.mark.timeout(300)

WIDE = {"COLUMNS": "250"}
ENDED = ("succeeded", "failed", "cancelled", "lost")


def container_agent(cluster: Cluster, engine: Engine, name: str, *, processes: bool = False, **kw: Any) -> Agent:
    extra = ["--backend", "process"] if processes else []
    return cluster.agent(name, extra_args=["--backend", "container", "--container-host", engine.url, *extra], **kw)


def login(srv: Server, registry: RegistryServer) -> None:
    user, password = registry.credentials
    r = cli(srv.api, "registry", "login", registry.host, "--username", user, input=password + "\n")
    assert r.returncode == 0, r.stderr


def containers(engine: Engine, node_id: str, *, running: bool = False) -> list[Any]:
    """The engine's containers labelled as this node's."""
    return engine.client.containers.list(all=not running, filters={"label": f"podium.node={node_id}"})  # type: ignore[attr-defined]


def the_running_one(engine: Engine, node_id: str) -> Any:
    """The one container the engine lists as running for this node, once it lists exactly one (None
    until then): podman's listing can leave out a running container while it updates its state (a
    fresh-clone CI run listed none right after the attempt's output had come)."""
    found = containers(engine, node_id, running=True)
    return found[0] if len(found) == 1 else None


def exists(engine: Engine, cid: str) -> bool:
    try:
        engine.client.api.inspect_container(cid)  # type: ignore[attr-defined]
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as e:
        if "no such container" in str(e):  # podman, while the removal is under way
            return False
        raise
    return True


def stdout_of(api: Api, tid: str, attempt: int | None = None) -> str:
    params: dict[str, Any] = {"limit": 10000}
    if attempt is not None:
        params["attempt"] = attempt
    r = api.http.get(f"/v1/tasks/{tid}/logs", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    chunks = body if isinstance(body, list) else body.get("chunks") or body.get("items") or []
    return "".join(c["data"] for c in chunks if c["stream"] == "stdout")


def node_row(api: Api, name: str) -> dict[str, Any]:
    return next(n for n in api.nodes() if n["name"] == name)


def test_an_image_runs_from_the_registry_with_its_login_pinned_streamed_and_proven_removed(
    cluster: Cluster, engine: Engine, registry: RegistryServer
) -> None:
    srv = cluster.server()
    api = cluster.api
    agent = container_agent(cluster, engine, "box")
    node = api.wait_node("box", 60, connected=True)
    assert "container" in node["backends"] and node["egress_contexts"] == ["none", "open"]
    assert node["enforces_limits"] == engine.enforces_limits
    listed = cli(srv.api, "nodes", extra_env=WIDE).stdout
    assert "container" in next(line for line in listed.splitlines() if " box " in line)

    note = f"image one {uuid.uuid4().hex[:8]}"
    repo = registry.unique_repo()
    digest = registry.push(repo, "1.0", busybox_image(note))
    image = f"{registry.host}/{repo}:1.0"

    # no login stored: the registry refuses, in its own words beside the constant reason
    refused = api.submit(backend="container", image=image, command=["true"], max_attempts=1)["id"]
    t = api.wait_state(refused, ENDED, 60)
    assert (t["state"], t["reason"]) == ("failed", reasons.REGISTRY_REFUSED)
    assert "authentication required" in (t["reason_detail"] or ""), t["reason_detail"]

    # with the login: pulled by digest on the node, output streamed, the exit code is the CLI's
    login(srv, registry)
    secret = f"s3cret-{uuid.uuid4().hex[:8]}"
    assert cli(srv.api, "secret", "set", "token", input=secret).returncode == 0
    r = cli(srv.api, "run", "--image", image, "--secret", "token:TOKEN", "--",
            "sh", "-c", 'cat /etc/podium-image; echo; echo "token=$TOKEN"; echo oops >&2; exit 3')  # fmt: skip
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert note in r.stdout and "oops" in r.stderr
    assert secret not in r.stdout and "token=" in r.stdout  # masked on the node
    tid = next(t["id"] for t in api.http.get("/v1/tasks").json() if t["id"] != refused)
    t = api.task(tid)
    assert (t["state"], t["image_digest"]) == ("failed", digest)
    # On a busy machine the engine may fail once to make the sandbox (a pull, a create or a start
    # refused under load: seen once in a full run, never alone): that attempt ends `provisioning`
    # and another is made, as the seed says. Any other end before the last is a defect; either way
    # the ends are printed with the engine's words.
    ends = [(a["attempt"], a["state"], a["failure_class"], a["reason"], a["failure_detail"]) for a in t["attempt_list"]]
    assert t["attempt_list"] and all(a["failure_class"] == "provisioning" for a in t["attempt_list"][:-1]), ends
    if len(ends) > 1:
        # said, not warned: the suite turns every warning into an error (pyproject's filterwarnings)
        print(f"\nthe engine could not make the sandbox before the attempt that ran: {ends[:-1]}", file=sys.stderr)
    attempt = t["attempt_list"][-1]
    assert (attempt["backend_kind"], attempt["failure_class"], attempt["exit_code"]) == ("container", "exit", 3)
    cid = attempt["backend_ref"]
    assert cid

    # shown with tag and digest
    shown = cli(srv.api, "show", tid, extra_env=WIDE)
    assert shown.returncode == 0 and image in shown.stdout and digest in shown.stdout

    # the release proof: the container is gone from the engine, the capacity free again
    wait_for(lambda: all(a["released"] for a in api.task(tid)["attempt_list"]), 60, what="the release proofs")
    attempt = api.task(tid)["attempt_list"][-1]
    assert attempt["release_proof"]["by"] == "node" and attempt["release_proof"]["backend_ref"] == cid
    assert not exists(engine, cid)
    row = node_row(api, "box")
    assert (row["reserved"]["slots"], row["releasing"]["slots"]) == (0, 0)
    assert containers(engine, agent.node_id()) == []
    # the pull changed what the node holds: it told the server (an Inventory)
    wait_for(lambda: digest in node_row(api, "box")["artifacts"], 60, what="the digest in the node's inventory")


def test_a_registry_that_is_down_keeps_the_task_queued_then_it_runs(
    cluster: Cluster, engine: Engine, registry_factory: Any
) -> None:
    srv = cluster.server()
    api = cluster.api
    container_agent(cluster, engine, "box")
    reg = registry_factory()
    repo = reg.unique_repo()
    reg.push(repo, "2.0", busybox_image("came back"))
    login(srv, reg)
    reg.stop()
    tid = api.submit(backend="container", image=f"{reg.host}/{repo}:2.0", command=["cat", "/etc/podium-image"])["id"]
    t = wait_for(lambda: (x := api.task(tid))["reason"] == reasons.REGISTRY_UNREACHABLE and x, 60,
                 what="the unreachable reason")  # fmt: skip
    assert t["state"] == "queued" and reg.host in (t["reason_detail"] or ""), t
    reg.start()  # the same port, the same storage
    t = api.wait_state(tid, ENDED, 120)
    assert t["state"] == "succeeded", t
    assert stdout_of(api, tid) == "came back"


def test_a_retry_after_the_agent_is_killed_runs_the_old_digest_and_no_container_outlives_the_fence(
    cluster: Cluster, engine: Engine, registry: RegistryServer
) -> None:
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    first = container_agent(cluster, engine, "first")
    first_id = first.node_id()
    api.wait_node("first", 60, connected=True)
    repo = registry.unique_repo()
    old = registry.push(repo, "stable", busybox_image("old image"))
    script = 'cat /etc/podium-image; echo; if [ "$PODIUM_ATTEMPT" = 1 ]; then sleep 600; fi'
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:stable", command=["sh", "-c", script])["id"]
    api.wait_state(tid, "running", 120)
    wait_for(lambda: "old image" in stdout_of(api, tid), 60, what="the first attempt's output")
    running = wait_for(lambda: the_running_one(engine, first_id), 30, what="the attempt's one container, running")

    # the tag moves to another image, then the node running the task dies outright
    new = registry.push(repo, "stable", busybox_image("new image"))
    assert new != old
    first.kill()
    # its fence keeper sees the agent gone and kills the container through the engine
    wait_for(lambda: containers(engine, first_id, running=True) == [], 30, what="the fence to kill the container")
    wait_for(lambda: any(e["ev"] == "fence" for e in first.journal_entries()), 30, what="the fence in the journal")

    second = container_agent(cluster, engine, "second")
    t = api.wait_state(tid, ENDED, 120)
    assert t["state"] == "succeeded", t
    assert t["image_digest"] == old
    last = t["attempt_list"][-1]
    assert last["node_id"] == second.node_id() and last["attempt"] >= 2
    assert stdout_of(api, tid, last["attempt"]) == "old image\n"
    assert_at_most_one_attempt_at_once([first, second])

    # the killed agent comes back: it finds its container, removes it and proves it
    cluster.agent("first", extra_args=["--backend", "container", "--container-host", engine.url])
    wait_for(lambda: not exists(engine, running.id), 60, what="the restarted agent to remove what it left")
    assert containers(engine, first_id) == []


def test_an_agent_whose_engine_answers_only_after_it_started_removes_what_an_earlier_instance_left_then(
    cluster: Cluster, engine: Engine, registry: RegistryServer, tmp_path: Any
) -> None:
    # An engine slow to come up (or too busy to answer at once) when the agent starts: what the
    # agent's killed predecessor left is removed, and proved removed, once the engine answers.
    if not engine.url.startswith("unix://"):
        pytest.skip("the engine is reached over TCP: its address cannot be made to appear later")
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    first = container_agent(cluster, engine, "box")
    node = first.node_id()
    api.wait_node("box", 60, connected=True)
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("left behind"))
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:1", command=["sleep", "600"], max_attempts=1)["id"]
    api.wait_state(tid, "running", 120)
    left = wait_for(lambda: the_running_one(engine, node), 30, what="the attempt's one container, running")
    first.kill()
    wait_for(lambda: containers(engine, node, running=True) == [], 30, what="the fence to kill the container")
    assert exists(engine, left.id), "the fence kills a container; removing it is the agent's"

    # the agent comes back, its engine's address not there yet: nothing can be listed or removed
    late = tmp_path / "late-engine.sock"
    mark = len(first.output())  # the restarted agent logs to the same file, after this
    again = cluster.agent("box", extra_args=["--backend", "container", "--container-host", f"unix://{late}"])

    def said(line: str) -> bool:
        return line in again.output()[mark:]

    wait_for(lambda: said("backend container: unavailable") and said("connected to"), 60,
             what="the restarted agent to start without an engine and connect")  # fmt: skip
    assert exists(engine, left.id)
    # the engine answers at that address now
    late.symlink_to(engine.url.removeprefix("unix://"))
    wait_for(lambda: not exists(engine, left.id), 60, what="the agent to remove what its predecessor left")
    wait_for(lambda: api.task(tid)["attempt_list"][-1]["released"], 60, what="the removal proved, the capacity freed")
    assert containers(engine, node) == []


def test_cancel_and_timeout_remove_the_container(cluster: Cluster, engine: Engine, registry: RegistryServer) -> None:
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    agent = container_agent(cluster, engine, "box")
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("sleeper"))
    image = f"{registry.host}/{repo}:1"
    cancelled = api.submit(backend="container", image=image, command=["sleep", "600"])["id"]
    timed_out = api.submit(backend="container", image=image, command=["sleep", "600"], timeout="2s", max_attempts=1)["id"]
    api.wait_state(cancelled, "running", 120)
    assert cli(srv.api, "cancel", cancelled).returncode == 0
    t = api.wait_state(cancelled, ENDED, 60)
    assert t["state"] == "cancelled" and t["attempt_list"][-1]["failure_class"] == "cancelled"
    t = api.wait_state(timed_out, ENDED, 120)
    assert (t["state"], t["reason"]) == ("failed", reasons.TIMEOUT)
    for tid in (cancelled, timed_out):
        wait_for(lambda tid=tid: api.task(tid)["attempt_list"][-1]["released"], 60, what="the release proof")
    wait_for(lambda: containers(engine, agent.node_id()) == [], 60, what="no container left on the engine")


def test_egress_none_cannot_reach_the_loopback_api(cluster: Cluster, engine: Engine, registry: RegistryServer) -> None:
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    container_agent(cluster, engine, "box")
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("net"))
    image = f"{registry.host}/{repo}:1"
    connections: list[object] = []
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, peer = listener.accept()
                connections.append(peer)
                conn.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        # the node as an `open` container sees it: the default network's gateway
        gateways = [cfg["Gateway"] for net in engine.client.networks.list()  # type: ignore[attr-defined]
                    if net.name in ("podman", "bridge") for cfg in (net.attrs.get("IPAM") or {}).get("Config") or ()
                    if cfg.get("Gateway")]  # fmt: skip
        gateway = gateways[0] if gateways else "10.88.0.1"
        probe = (f"busybox nc -w 3 127.0.0.1 {srv.port} </dev/null && echo reached-api; "
                 f"busybox nc -w 3 {gateway} {port} </dev/null && echo reached-node; true")  # fmt: skip
        none = api.submit(backend="container", image=image, command=["sh", "-c", probe], egress="none")["id"]
        t = api.wait_state(none, ENDED, 120)
        assert t["state"] == "succeeded", t
        assert "reached" not in stdout_of(api, none) and connections == []
        # `open`: the node's listener on its gateway address is reachable (podman's bridge works here)
        opened = api.submit(backend="container", image=image, command=["sh", "-c", probe], egress="open")["id"]
        assert api.wait_state(opened, ENDED, 120)["state"] == "succeeded"
        if not gateways:
            pytest.skip("the engine has no bridge network with a gateway here: `open` cannot be shown to reach the node")
        assert "reached-node" in stdout_of(api, opened) and len(connections) == 1
    finally:
        listener.close()


def test_oom_is_its_own_class(cluster: Cluster, engine: Engine, registry: RegistryServer) -> None:
    if not engine.enforces_limits:
        pytest.skip(engine.limits_reason)
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    container_agent(cluster, engine, "box")
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("hog"))
    # a shell variable that doubles until it no longer fits in 32Mi
    hog = ["sh", "-c", "x=aaaaaaaaaaaaaaaa; while true; do x=$x$x; done"]
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:1", command=hog,
                     resources={"memory": "32Mi"}, max_attempts=1)["id"]  # fmt: skip
    t = api.wait_state(tid, ENDED, 120)
    assert (t["state"], t["reason"], t["attempt_list"][-1]["failure_class"]) == ("failed", reasons.OOM, "oom"), t


def test_placement_prefers_the_node_that_holds_the_digest(cluster: Cluster, engine: Engine, registry: RegistryServer) -> None:
    """Two engines: the warm node's already holds the image, the cold node's does not."""
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    repo = registry.unique_repo()
    digest = registry.push(repo, "1", busybox_image("warm"))
    image = f"{registry.host}/{repo}:1"
    user, password = registry.credentials
    engine.client.api.pull(f"{registry.host}/{repo}", tag=digest,  # type: ignore[attr-defined]
                           auth_config={"username": user, "password": password})  # fmt: skip
    with running_engine() as cold_engine:
        cold = container_agent(cluster, cold_engine, "cold", slots=8)
        warm = container_agent(cluster, engine, "warm", slots=8, processes=True)
        wait_for(lambda: digest in node_row(api, "warm")["artifacts"], 60, what="the warm node's inventory")
        api.wait_node("cold", 60, connected=True)
        assert digest not in node_row(api, "cold")["artifacts"]
        # the cold node is emptier (spread would pick it), yet the warm one holds the image
        busy = [api.submit(command=["sleep", "600"], home_node=warm.node_id())["id"] for _ in range(2)]
        for b in busy:
            api.wait_state(b, "running", 60)
        tid = api.submit(backend="container", image=image, command=["cat", "/etc/podium-image"])["id"]
        t = api.wait_state(tid, ENDED, 120)
        assert t["state"] == "succeeded" and t["attempt_list"][-1]["node_id"] == warm.node_id(), t
        explained = cli(srv.api, "explain", tid, extra_env=WIDE)
        assert explained.returncode == 0
        warm_line = next(line for line in explained.stdout.splitlines() if "warm" in line)
        cold_line = next(line for line in explained.stdout.splitlines() if "cold" in line)
        assert "holds sha256:" in warm_line and "holds" not in cold_line, explained.stdout
        d = json.loads(cli(srv.api, "explain", "--json", tid).stdout)
        assert {n["name"]: n["holds"] for n in d["nodes"]} == {"warm": [digest], "cold": []}
        for b in busy:
            cli(srv.api, "cancel", b)
        cold.stop()
        warm.stop()


def test_release_proof_frees_capacity_only_after_removal(cluster: Cluster, engine: Engine, registry: RegistryServer) -> None:
    """Sampled from the first output to the proof: whenever the node's row shows the slot free, the
    container is already gone (the row is read first, then the engine is asked: a container that
    exists after a row that said "free" existed when the row was read). Seen between exit and
    removal, the slot is shown as releasing."""
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    agent = container_agent(cluster, engine, "box", slots=1)
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("proof"))
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:1", command=["sleep", "2"], max_attempts=1)["id"]
    api.wait_state(tid, "running", 120)
    (c,) = containers(engine, agent.node_id())
    samples = 0
    releasing_seen = 0
    while True:
        t = api.task(tid)
        row = node_row(api, "box")
        present = exists(engine, c.id)
        samples += 1
        if present:
            assert row["reserved"]["slots"] == 1, (row, t["state"])
            if t["state"] in ENDED:
                assert row["releasing"]["slots"] == 1, row
                releasing_seen += 1
        if t["state"] in ENDED and t["attempt_list"][-1]["released"]:
            break
        assert samples < 100_000
        time.sleep(0.01)
    assert t["state"] == "succeeded" and not exists(engine, c.id)
    row = node_row(api, "box")
    assert (row["reserved"]["slots"], row["releasing"]["slots"]) == (0, 0)


def test_container_is_offered_only_while_the_engine_answers(cluster: Cluster, engine: Engine, tmp_path: Any) -> None:
    """The agent's engine socket is a symlink the test makes and removes: the node's backends follow
    within a few heartbeats (a new Hello), and what the engine holds arrives with it."""
    cluster.server()
    api = cluster.api
    link = tmp_path / "engine.sock"
    cluster.agent("flaky", extra_args=["--backend", "process", "--backend", "container", "--container-host", f"unix://{link}"])
    node = api.wait_node("flaky", 60, connected=True)
    assert node["backends"] == ["process"] and node["egress_contexts"] == ["open"]
    link.symlink_to(engine.url.removeprefix("unix://"))
    node = wait_for(lambda: "container" in (n := node_row(api, "flaky"))["backends"] and n, 60, what="container offered")
    assert node["egress_contexts"] == ["none", "open"] and node["artifacts"], node
    link.unlink()
    wait_for(lambda: node_row(api, "flaky")["backends"] == ["process"], 60, what="container withdrawn")


def test_an_agent_cut_off_has_its_container_killed_before_the_task_moves(
    cluster: Cluster, engine: Engine, registry: RegistryServer
) -> None:
    """The agent frozen (SIGSTOP): its fence keeper, still running, kills the container through the
    engine when the lease runs out — before the server may place the task elsewhere."""
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    a = container_agent(cluster, engine, "a", labels={"x": "1"})
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("cut off"))
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:1", command=["sh", "-c", "sleep 20; echo finished"],
                     labels={"x": "1"}, max_attempts=3)["id"]  # fmt: skip
    first = api.wait_state(tid, "running", 120)
    a_id = a.node_id()
    wait_for(lambda: containers(engine, a_id, running=True), 30, what="the container running")
    a.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: containers(engine, a_id, running=True) == [], 30, what="the fence to kill the container")
        assert api.task(tid)["fencing_token"] == first["fencing_token"]  # not given away before that
        b = container_agent(cluster, engine, "b", labels={"x": "1"}, slots=1)
        second = wait_for(lambda: (t := api.task(tid))["state"] == "running" and t["node_id"] == b.node_id() and t,
                          120, what="the task running on b")  # fmt: skip
        assert second["fencing_token"] > first["fencing_token"]
    finally:
        a.signal(signal.SIGCONT)
    t = api.wait_state(tid, ENDED, 120)
    assert t["state"] == "succeeded" and [x["state"] for x in t["attempt_list"]] == ["lost", "exited"]
    assert stdout_of(api, tid, 2) == "finished\n"
    # a, thawed, removes what the fence stopped: nothing of its is left on the engine
    wait_for(lambda: containers(engine, a_id) == [], 60, what="a to remove its fenced container")
    assert_at_most_one_attempt_at_once([a, b])


def test_dev_with_containers_offers_them_through_docker_host(engine: Engine, tmp_path: Any) -> None:
    """`podium dev --containers`: the local agent runs containers from the engine DOCKER_HOST names."""
    port, grpc_port = free_port(), free_port()
    env = base_env(DOCKER_HOST=engine.url, XDG_DATA_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path))
    env.pop("PODIUM_DATABASE_URL", None)
    env.pop("PODIUM_TOKEN", None)
    with open(tmp_path / "dev.log", "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "podium", "dev", "--containers", "--data-dir", str(tmp_path / "data"),
                              "--port", str(port), "--grpc-port", str(grpc_port)],
                             env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        admin = wait_for(lambda: (tmp_path / "data" / "admin-token").exists() and (tmp_path / "data" / "admin-token").read_text().strip(),
                         60, what="podium dev to start")  # fmt: skip
        with Api(f"http://127.0.0.1:{port}", token=admin) as api:
            node = wait_for(lambda: next((n for n in api.nodes() if n["name"] == "local" and "container" in n["backends"]), None),
                            60, what="the local agent offering containers")  # fmt: skip
            assert set(node["backends"]) == {"process", "container"} and "none" in node["egress_contexts"]
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def test_a_container_cancelled_while_provisioning_never_starts_and_is_removed(
    cluster: Cluster, engine: Engine, registry: RegistryServer
) -> None:
    srv = cluster.server()
    api = cluster.api
    login(srv, registry)
    agent = container_agent(cluster, engine, "slow", extra_env={"PODIUM_TEST_AGENT_PROVISION_DELAY": "3"})
    repo = registry.unique_repo()
    registry.push(repo, "1", busybox_image("never"))
    tid = api.submit(backend="container", image=f"{registry.host}/{repo}:1", command=["echo", "started"])["id"]
    api.wait_state(tid, "provisioning", 60)
    # through the API, at once: a CLI process's start can take most of the 3 s on a busy machine
    api.http.post(f"/v1/tasks/{tid}/cancel").raise_for_status()
    t = api.wait_state(tid, ENDED, 60)
    assert t["state"] == "cancelled" and stdout_of(api, tid) == ""
    wait_for(lambda: api.task(tid)["attempt_list"][-1]["released"], 60, what="the release proof")
    assert containers(engine, agent.node_id()) == []
    assert not [e for e in agent.journal_entries() if e["ev"] == "start"]
