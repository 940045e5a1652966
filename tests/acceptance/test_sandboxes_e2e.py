"""Sandboxes end to end, server side: real servers, real agents (process backend) and the real CLI.

The container half speaks the real agent protocol through `ProtocolNode` (a protocol client, not a
stand-in for the agent): the agent's container backend is built in another branch, and what is
tested here is the server's side of the contract — the pinned image in the Assign, the node's
failure class and words, the capacity held until the node's release proof, egress placement, the
inventory.
"""

from __future__ import annotations

import json
import time
from typing import Any

from podium import reasons
from podium.proto.podium.v1 import agent_pb2 as pb
from tests.acceptance.conftest import Cluster
from tests.harness import cli, wait_for
from tests.protocol_node import ProtocolNode

K = pb.TaskEvent.Kind
DIGEST = "sha256:" + "ab" * 32
WIDE = {"COLUMNS": "250"}  # a table as wide as it needs: no class folded across two lines


def _show(addr: str, tid: str) -> tuple[dict[str, Any], str]:
    shown = cli(addr, "show", "--json", tid)
    assert shown.returncode == 0, shown.stderr
    text = cli(addr, "show", tid, extra_env=WIDE)
    assert text.returncode == 0, text.stderr
    return json.loads(shown.stdout), text.stdout


def _attempt_row(text: str, number: int) -> list[str]:
    """The attempts table's row for attempt `number`, split into words."""
    in_table = False
    for line in text.splitlines():
        if line.strip() == "attempts":
            in_table = True
        elif line.strip() == "events":
            break
        elif in_table and line.split()[:1] == [str(number)]:
            return line.split()
    raise AssertionError(f"no row for attempt {number} in:\n{text}")


def test_show_gives_every_attempt_of_a_process_task_its_failure_class(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("a1")
    api = cluster.api

    failed = cli(srv.api, "run", "--detach", "--", "sh", "-c", "echo boom >&2; exit 3").stdout.strip()
    timed_out = cli(srv.api, "run", "--detach", "--timeout", "1s", "--", "sleep", "600").stdout.strip()
    cancelled = cli(srv.api, "run", "--detach", "--", "sleep", "600").stdout.strip()
    ok = cli(srv.api, "run", "--detach", "--", "true").stdout.strip()
    api.wait_state(cancelled, "running", 60)
    assert cli(srv.api, "cancel", cancelled).returncode == 0

    expected = {
        failed: ("failed", "exit", reasons.EXITED_NONZERO),
        timed_out: ("failed", "timeout", reasons.TIMEOUT),
        cancelled: ("cancelled", "cancelled", reasons.CANCELLED),
    }
    for tid, (state, cls, reason) in expected.items():
        t = api.wait_state(tid, state, 60)
        assert t["reason"] == reason
        d, text = _show(srv.api, tid)
        (attempt,) = d["attempt_list"]
        # in the API: on the attempt and on the event of its end
        assert (attempt["failure_class"], attempt["reason"], attempt["backend_kind"]) == (cls, reason, "process")
        assert attempt["released"] and attempt["release_proof"] is None  # a process: released with its end
        assert [(e["to_state"], e["failure_class"]) for e in d["events"]][-1] == (state, cls)
        # in `podium show`: the attempt history's CLASS column
        row = _attempt_row(text, 1)
        assert row[3:5] == [attempt["state"], cls], row
        # and in its event history, on the end
        last = [line.split() for line in text.split("\nevents", 1)[1].splitlines() if line.strip()][-1]
        assert last[2] == state and cls in last, last
    d, text = _show(srv.api, api.wait_state(ok, "succeeded", 60)["id"])
    assert d["attempt_list"][0]["failure_class"] is None
    assert _attempt_row(text, 1)[3] == "exited" and "exit" not in _attempt_row(text, 1)[4:5]


def _container_node(cluster: Cluster, node_id: str, **kw: Any) -> ProtocolNode:
    """A node offering the container backend, heartbeating as an agent does with fast timers."""
    join = cluster.servers[0].data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(cluster.servers[0].grpc, node_id, join, backends=("container",), heartbeat=0.5, **kw)
    node.next("welcome")
    return node


def _events(node: ProtocolNode, task_id: str, token: int, *events: dict[str, Any]) -> None:
    for e in events:
        node.send(pb.AgentMessage(event=pb.TaskEvent(task_id=task_id, fencing_token=token, **e)))


def _proof(node: ProtocolNode, task_id: str, token: int, ref: str) -> None:
    node.send(pb.AgentMessage(released=pb.ReleaseProof(task_id=task_id, fencing_token=token, backend_ref=ref,
                                                        released_at=time.time())))  # fmt: skip


def _refused_proofs(api_base: str) -> float:
    from tests.harness import Api

    with Api(api_base) as api:
        text = api.http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith('podium_release_proofs_total{outcome="refused"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_container_attempt_holds_its_capacity_until_its_node_proves_the_sandbox_gone(cluster: Cluster) -> None:
    srv = cluster.server()
    api = cluster.api
    open_only = _container_node(cluster, "open-box", slots=1, egress_contexts=("open",))
    image = f"registry.example.com/team/app:1.4@{DIGEST}"  # pinned already: no registry is asked
    tid = api.submit(backend="container", image=image, egress="none", command=["python3", "job.py"], max_attempts=1)["id"]

    # nobody can cut it off from the network yet: queued, saying so, and `explain` says why per node
    wait_for(lambda: api.task(tid)["reason"] == reasons.NO_EGRESS, 30, what="the egress reason")
    explained = cli(srv.api, "explain", tid, extra_env=WIDE)
    assert explained.returncode == 0 and reasons.NO_EGRESS in " ".join(explained.stdout.split())
    assert api.task(tid)["image_digest"] == DIGEST

    box = _container_node(cluster, "box", slots=1, egress_contexts=("none", "open"), enforces_limits=True)
    # answered at once, as an agent does: the Assign goes out when the node connects, and with fast
    # timers its node has 1.5 s to say provisioning (a CLI call first can take longer on a busy machine)
    assign = box.next("assign", 60).assign
    assert assign.task_id == tid
    token = assign.fencing_token
    _events(box, tid, token, {"kind": K.PROVISIONING})
    box.next("accepted")
    sent = json.loads(assign.spec_json)
    assert sent["image"] == f"registry.example.com/team/app@{DIGEST}" and sent["command"] == ["python3", "job.py"]
    node = api.wait_node("box", 30, connected=True)
    assert (node["egress_contexts"], node["enforces_limits"]) == (["none", "open"], True)
    listed = cli(srv.api, "nodes", extra_env=WIDE).stdout
    assert "enforced" in listed and "none,open" in listed

    _events(box, tid, token, {"kind": K.RUNNING, "backend_ref": "c0ffee"}, {"kind": K.EXITED, "exit_code": 0})
    assert box.next("ack").ack.fencing_token == token
    t = api.wait_state(tid, "succeeded", 30)
    (attempt,) = t["attempt_list"]
    assert (attempt["backend_kind"], attempt["backend_ref"], attempt["released"]) == ("container", "c0ffee", False)

    # the exit alone frees nothing: the node shows the slot as still releasing
    node = api.wait_node("box", 30)
    assert (node["reserved"]["slots"], node["releasing"]["slots"]) == (1, 1)
    assert "1 (" in " ".join(line for line in cli(srv.api, "nodes", extra_env=WIDE).stdout.splitlines() if " box " in line)
    assert "proven removed" in _show(srv.api, tid)[1]

    refused = _refused_proofs(srv.api)
    _proof(box, tid, token, "not-that-container")  # refused: another container
    _proof(box, tid, token + 1, "c0ffee")  # refused: not its attempt's token
    _proof(box, tid, token, "c0ffee")
    api.wait_node("box", 30, releasing={"cpu_millis": 0, "memory_bytes": 0, "disk_bytes": 0, "gpus": 0, "slots": 0})
    assert api.nodes()[[n["name"] for n in api.nodes()].index("box")]["reserved"]["slots"] == 0
    (attempt,) = api.task(tid)["attempt_list"]
    assert attempt["released"] and attempt["release_proof"]["by"] == "node"
    assert attempt["release_proof"]["backend_ref"] == "c0ffee"
    _proof(box, tid, token, "c0ffee")  # a repeat: refused and harmless
    wait_for(lambda: _refused_proofs(srv.api) >= refused + 3, 30, what="the three refused proofs")
    box_row = next(n for n in api.nodes() if n["name"] == "box")
    assert (box_row["reserved"]["slots"], box_row["releasing"]["slots"]) == (0, 0)

    # the node's inventory changed: placement will prefer it for that digest
    box.send(pb.AgentMessage(inventory=pb.Inventory(artifacts=[DIGEST])))
    api.wait_node("box", 30, artifacts=[DIGEST])

    # a node's own class and words for an end: an OOM kill
    oom = api.submit(backend="container", image=image, resources={"memory": "64Mi"}, max_attempts=1)["id"]
    assign = box.next("assign", 60).assign
    assert assign.task_id == oom
    _events(box, oom, assign.fencing_token, {"kind": K.PROVISIONING})
    box.next("accepted")
    _events(box, oom, assign.fencing_token, {"kind": K.RUNNING, "backend_ref": "beef"},
            {"kind": K.EXITED, "exit_code": 137, "failure_class": "oom", "message": "OOMKilled: memory limit 64Mi"})
    t = api.wait_state(oom, "failed", 30)
    assert (t["reason"], t["reason_detail"]) == (reasons.OOM, "OOMKilled: memory limit 64Mi")
    (attempt,) = t["attempt_list"]
    assert (attempt["failure_class"], attempt["failure_detail"], attempt["exit_code"]) == (
        "oom", "OOMKilled: memory limit 64Mi", 137)
    d, text = _show(srv.api, oom)
    assert _attempt_row(text, 1)[3:5] == ["exited", "oom"]
    assert "OOMKilled: memory limit 64Mi" in text and f"registry.example.com/team/app:1.4@{DIGEST}" in text
    assert DIGEST in text
    for n in (open_only, box):
        n.close()


def test_run_with_an_image_and_bad_input_in_one_clear_line(cluster: Cluster) -> None:
    srv = cluster.server()
    api = cluster.api
    bad = cli(srv.api, "run", "--image", "Team/App:1.4", "--", "true")
    assert bad.returncode == 1 and "image" in bad.stderr and "not an image reference" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = cli(srv.api, "run", "--image", "busybox", "--egress", "closed", "--", "true")
    assert bad.returncode == 1 and "egress" in bad.stderr and "'none' or 'open'" in bad.stderr
    bad = cli(srv.api, "run", "--egress", "none", "--", "true")
    assert bad.returncode == 1 and "egress none is only for the container backend" in bad.stderr
    bad = cli(srv.api, "run")
    assert bad.returncode == 1 and "needs a command" in bad.stderr
    assert api.http.get("/v1/tasks").json() == []  # nothing of it was stored

    # an image with no command runs the image's own; by digest, it is pinned without a registry
    tid = cli(srv.api, "run", "--detach", "--image", f"busybox@{DIGEST}", "--egress", "open").stdout.strip()
    t = wait_for(lambda: (t := api.task(tid))["image_digest"] and t, 30, what="the digest pinned")
    assert (t["spec"]["backend"], t["spec"]["command"], t["spec"]["egress"], t["image"]) == (
        "container", [], "open", f"busybox@{DIGEST}")
    assert t["state"] == "queued"
    d, text = _show(srv.api, tid)
    assert f"digest:   {DIGEST}" in text and "(the image's own)" in text


def test_a_container_assign_that_cannot_be_sent_frees_its_capacity_at_once(cluster: Cluster) -> None:
    """Its secret was deleted before the Assign: the node never got anything, so there is nothing for
    it to prove removed — the capacity is released with the end."""
    cluster.server()
    api = cluster.api
    assert api.http.put("/v1/secrets/db-password", json={"value": "hunter2"}).status_code == 201
    tid = api.submit(backend="container", image=f"busybox@{DIGEST}", secrets=[{"name": "db-password", "env": "PW"}],
                     max_attempts=1)["id"]  # fmt: skip
    assert api.http.delete("/v1/secrets/db-password").status_code == 204
    box = _container_node(cluster, "box", slots=1)
    try:
        t = api.wait_state(tid, "failed", 60)
        assert t["reason"] == reasons.SECRET_MISSING
        (attempt,) = t["attempt_list"]
        assert (attempt["failure_class"], attempt["released"]) == ("provisioning", True)
        assert attempt["release_proof"] == {"by": "server", "reason": reasons.SECRET_MISSING}
        node = api.wait_node("box", 30)
        assert (node["reserved"]["slots"], node["releasing"]["slots"]) == (0, 0)
    finally:
        box.close()
