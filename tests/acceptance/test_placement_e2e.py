"""Placement with real agents: the reason `podium show` gives for each case, and a queued task that
starts as soon as its cause goes away."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from podium import reasons
from tests.acceptance.conftest import Cluster
from tests.harness import cli, held_until, wait_for


def show(addr: str, tid: str) -> dict:
    r = cli(addr, "show", "--json", tid)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_reason_with_a_real_agent(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("small", labels={"zone": "eu-1"}, slots=1, cpu="2", memory="4Gi")
    api = cluster.api
    busy = api.submit(command=["sleep", "600"], resources={"cpu": "1500m"})["id"]
    api.wait_state(busy, "running", 60)
    cases = {
        reasons.NO_LABELS: {"command": ["true"], "labels": {"zone": "us-2"}},
        reasons.NO_POOL: {"command": ["true"], "pool": "gpu-pool"},
        reasons.NO_ARCH: {"command": ["true"], "arch": "riscv64"},
        reasons.NO_CAPABILITY: {"command": ["true"], "capabilities": ["kvm"]},
        reasons.NO_BACKEND: {"backend": "container", "image": "localhost/busybox@sha256:" + "b" * 64},  # no tag to resolve
        reasons.NO_PROTOCOL: {"command": ["true"], "protocol": 2},
        reasons.HOME_UNAVAILABLE: {"command": ["true"], "home_node": "n-nowhere"},
        reasons.TOO_LARGE: {"command": ["true"], "resources": {"cpu": 64}},
        reasons.NO_ROOM: {"command": ["true"], "resources": {"cpu": 1}},
        reasons.FULL: {"command": ["true"], "resources": {"cpu": "100m"}},
    }
    ids = {reason: api.submit(**spec)["id"] for reason, spec in cases.items()}
    for reason, tid in ids.items():
        wait_for(lambda tid=tid, reason=reason: show(srv.api, tid)["reason"] == reason, 30,  # type: ignore[misc]
                 what=f"reason {reason!r}")  # fmt: skip
        assert show(srv.api, tid)["state"] == "queued"
    # the sentence an operator reads
    text = cli(srv.api, "show", ids[reasons.NO_LABELS]).stdout
    assert reasons.NO_LABELS in " ".join(text.split())
    # why not this node? the first check it fails
    ex = json.loads(cli(srv.api, "explain", "--json", ids[reasons.NO_LABELS]).stdout)
    assert [(n["name"], n["fits"], n["failed"]) for n in ex["nodes"]] == [("small", False, reasons.NO_LABELS)]
    # when the room comes back, the waiting tasks start
    cli(srv.api, "cancel", busy)
    for reason in (reasons.NO_ROOM, reasons.FULL):
        api.wait_state(ids[reason], "succeeded", 60)


def test_a_label_change_starts_the_task_and_an_undrain_too(cluster: Cluster) -> None:
    srv = cluster.server()
    agent = cluster.agent("n1")
    node_id = agent.node_id()
    api = cluster.api
    api.wait_node("n1", 30, connected=True)
    tid = cli(srv.api, "run", "--detach", "--label", "gpu=a100", "--", "echo", "labelled").stdout.strip()
    wait_for(lambda: api.task(tid)["reason"] == reasons.NO_LABELS, 30)
    r = cli(srv.api, "label", "n1", "gpu=a100")
    assert r.returncode == 0 and "gpu=a100" in r.stdout, r.stderr
    api.wait_state(tid, "succeeded", 60)

    assert cli(srv.api, "drain", "n1").returncode == 0
    tid2 = cli(srv.api, "run", "--detach", "--", "echo", "after drain").stdout.strip()
    wait_for(lambda: api.task(tid2)["reason"] == reasons.ALL_DRAINING, 30)
    assert api.task(tid2)["state"] == "queued"
    assert cli(srv.api, "undrain", node_id).returncode == 0
    api.wait_state(tid2, "succeeded", 60)
    # removing the label puts the node out of reach of labelled work again
    assert cli(srv.api, "label", "n1", "gpu-").returncode == 0
    assert api.nodes()[0]["labels"] == {}


def test_a_task_waits_for_a_matching_node_to_appear(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("plain")
    tid = cli(srv.api, "run", "--detach", "--label", "zone=eu-9", "--", "true").stdout.strip()
    wait_for(lambda: cluster.api.task(tid)["reason"] == reasons.NO_LABELS, 30)
    cluster.agent("eu9", labels={"zone": "eu-9"})
    t = cluster.api.wait_state(tid, "succeeded", 60)
    assert t["attempt_list"][0]["node_id"] == cluster.agents[1].node_id()


def test_a_home_pinned_task_runs_only_on_its_home(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a")
    b = cluster.agent("b")
    home = b.node_id()
    for _ in range(4):
        tid = cli(srv.api, "run", "--detach", "--home-node", home, "--", "true").stdout.strip()
        t = cluster.api.wait_state(tid, "succeeded", 60)
        assert t["attempt_list"][0]["node_id"] == home
    assert a.node_id() != home


def test_a_named_spec_pinned_to_a_stale_revision_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    srv = cluster.server()
    cluster.agent("a")
    f = tmp_path / "spec.yaml"
    f.write_text("command: [sh, -c, 'echo v1']\n")
    assert "revision 1" in cli(srv.api, "spec", "put", "nightly", str(f)).stdout
    f.write_text("command: [sh, -c, 'echo v2']\n")
    assert "revision 2" in cli(srv.api, "spec", "put", "nightly", str(f)).stdout
    stale = cli(srv.api, "spec", "run", "nightly", "--revision", "1")
    assert stale.returncode == 1 and "is at revision 2" in stale.stderr and "pinned to revision 1" in stale.stderr
    assert json.loads(cli(srv.api, "ls", "--json").stdout) == []  # nothing was stored
    ok = cli(srv.api, "spec", "run", "nightly", "--revision", "2")
    assert ok.returncode == 0 and ok.stdout == "v2\n", ok.stderr
    t = json.loads(cli(srv.api, "ls", "--json").stdout)[0]
    assert (t["spec_name"], t["spec_revision"]) == ("nightly", 2)


def test_gpu_tasks_see_only_their_devices(cluster: Cluster, tmp_path: Path) -> None:
    # FAKE, named as such: there is no GPU on these machines, so a stand-in nvidia-smi reports two.
    # Everything else (placement, the indexes in the Assign, the environment) is the real code.
    bindir = tmp_path / "fake-nvidia-bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    srv = cluster.server()
    cluster.agent("gpu", extra_env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    cluster.api.wait_node("gpu", 30, connected=True)
    assert cluster.api.nodes()[0]["gpu_indexes"] == [0, 1]
    # the first two hold their GPUs until the test has seen the third wait for one (a sleep of a fixed
    # length ran out on a slow machine before the third was even submitted), for two minutes at most
    release = tmp_path / "release"
    hold = f"echo $CUDA_VISIBLE_DEVICES; {held_until(release)}"
    one = cli(srv.api, "run", "--detach", "--gpus", "1", "--", "sh", "-c", hold).stdout.strip()
    two = cli(srv.api, "run", "--detach", "--gpus", "1", "--", "sh", "-c", hold).stdout.strip()
    three = cli(srv.api, "run", "--detach", "--gpus", "1", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES").stdout.strip()
    cluster.api.wait_state(one, "running", 60)
    cluster.api.wait_state(two, "running", 60)
    wait_for(lambda: cluster.api.task(three)["reason"] == reasons.NO_GPU, 30)
    assert cluster.api.task(three)["state"] == "queued"
    release.touch()
    assert {cluster.api.wait_state(t, "succeeded", 60)["state"] for t in (one, two)} == {"succeeded"}
    seen = {cli(srv.api, "logs", t).stdout.strip() for t in (one, two)}
    assert seen == {"0", "1"}
    cluster.api.wait_state(three, "succeeded", 60)
    none = cli(srv.api, "run", "--", "sh", "-c", "echo [$CUDA_VISIBLE_DEVICES]")
    assert none.stdout == "[]\n"
