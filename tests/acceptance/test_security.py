"""Security by default: who may do what, nodes that may act only as themselves, secrets that stay
secret, and an audit of every operator action. Real server, real agents, real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import uuid

import httpx
import pytest

from podium import reasons
from podium.proto.podium.v1 import agent_pb2 as pb
from tests.acceptance.conftest import Cluster
from tests.harness import Api, cli, wait_for
from tests.protocol_node import ProtocolNode

K = pb.TaskEvent.Kind
SECRET = "s3cr3t-Value-7f1c9a"


def make_token(srv_api: str, name: str, role: str) -> str:
    r = cli(srv_api, "token", "create", name, "--role", role)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_roles_and_revocation(cluster: Cluster) -> None:
    srv = cluster.server()
    http = httpx.Client(base_url=srv.api, timeout=30)
    try:
        # nothing without a token, and the answer says how to give one
        r = http.get("/v1/tasks")
        assert r.status_code == 401 and "bearer token" in r.json()["error"]
        assert http.get("/v1/tasks", headers={"Authorization": "Bearer nonsense"}).status_code == 401
        viewer, operator = make_token(srv.api, "v", "viewer"), make_token(srv.api, "o", "operator")
        join = make_token(srv.api, "j", "join")
        with Api(srv.api, operator) as o:
            tid = o.submit(command=["sleep", "60"])["id"]
        v = Api(srv.api, viewer)
        assert v.http.get("/v1/tasks").status_code == 200
        r = v.http.post(f"/v1/tasks/{tid}/cancel")
        assert r.status_code == 403 and "viewer" in r.json()["error"]
        assert v.http.post("/v1/tasks", json={"command": ["true"]}).status_code == 403
        o = Api(srv.api, operator)
        assert o.http.post("/v1/tokens", json={"name": "x", "role": "admin"}).status_code == 403
        assert o.http.put("/v1/secrets/x", json={"value": "y"}).status_code == 403
        # a join token joins nodes and does nothing else
        with Api(srv.api, join) as j:
            assert j.http.get("/v1/tasks").status_code == 403
        # revoked: refused at once, on the very next call
        token_id = operator.split("_", 1)[1].split(".")[0]
        assert cli(srv.api, "token", "revoke", token_id).returncode == 0
        r = o.http.get("/v1/tasks")
        assert r.status_code == 401 and "revoked" in r.json()["error"]
        assert cli(srv.api, "cancel", tid, token=operator).returncode == 1
        # the CLI says what is wrong in one line
        r = cli(srv.api, "ls", token="")
        assert r.returncode == 1 and "PODIUM_TOKEN" in r.stderr and "Traceback" not in r.stderr
        # every operator action was audited with who did it
        actions = {(a["action"], a["actor"].split(" ")[0]) for a in json.loads(cli(srv.api, "audit", "--json").stdout)}
        assert ("task.submit", "o") in actions and ("token.revoke", "bootstrap-admin") in actions
        for api in (v, o):
            api.close()
    finally:
        http.close()


def test_nodes_act_only_as_themselves(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a", labels={"who": "a"})
    b = cluster.agent("b", labels={"who": "b"})
    api = cluster.api
    tid = api.submit(command=["sleep", "30"], labels={"who": "a"})["id"]
    t = api.wait_state(tid, "running", 60)
    token = t["fencing_token"]
    b_id = b.node_id()
    b_cred = wait_for(lambda: (b.state_dir / "credential").exists() and (b.state_dir / "credential").read_text().strip(), 30)
    # b's credential is b's alone: it cannot be a
    impostor = ProtocolNode(srv.grpc, a.node_id(), b_cred)
    assert impostor.wait_closed().code().name == "UNAUTHENTICATED"
    impostor.close()
    # a join token cannot take over an enrolled node either
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    takeover = ProtocolNode(srv.grpc, a.node_id(), join)
    assert takeover.wait_closed().code().name == "UNAUTHENTICATED"
    takeover.close()
    # a rogue b, with its valid credential, reports on a's task: refused, nothing changes
    b.stop()
    rogue = ProtocolNode(srv.grpc, b_id, b_cred)
    rogue.next("welcome")
    rogue.event(tid, token, K.RUNNING)
    cancel = rogue.next("cancel")  # told to stop what is not its attempt
    assert cancel.cancel.task_id == tid
    rogue.event(tid, token, K.EXITED, exit_code=0)
    assert rogue.next("ack").ack.fencing_token == token  # an end that is not its own: refused
    t = api.task(tid)
    assert (t["state"], t["node_id"], t["fencing_token"]) == ("running", a.node_id(), token)
    # and a node credential is no key to the operator API
    r = httpx.get(f"{srv.api}/v1/tasks", headers={"Authorization": f"Bearer {b_cred}"})
    assert r.status_code == 401
    rogue.close()
    # a's own replay of an old token after a new attempt is refused too
    a.kill()
    t = api.wait_state(tid, "queued", 60)
    new_node = cluster.agent("a2", labels={"who": "a"})
    t = api.wait_state(tid, "running", 60)
    assert t["fencing_token"] > token
    a_cred = (a.state_dir / "credential").read_text().strip()
    replay = ProtocolNode(srv.grpc, a.node_id(), a_cred)
    replay.next("welcome")
    replay.event(tid, token, K.EXITED, exit_code=0)
    assert replay.next("ack").ack.fencing_token == token  # an old attempt's end: acknowledged, not applied
    t = api.task(tid)
    assert t["state"] == "running" and t["node_id"] == new_node.node_id()
    replay.close()


def test_a_removed_node_is_disconnected_and_cannot_rejoin(cluster: Cluster) -> None:
    srv = cluster.server()
    a = cluster.agent("a")
    api = cluster.api
    tid = api.submit(command=["sleep", "60"], requeue_on_node_loss=False)["id"]
    api.wait_state(tid, "running", 60)
    assert cli(srv.api, "revoke", "a").returncode == 0
    t = api.wait_state(tid, ("lost", "queued"), 30)
    assert (t["state"], t["reason"]) == ("lost", reasons.NODE_REVOKED)
    assert a.p is not None and a.p.wait(30) == 3  # the agent is told, stops its work, and exits
    assert "removed from the fleet" in a.output()
    restarted = cluster.agent("a")  # same name, same state dir: same node id and credential
    assert restarted.p is not None and restarted.p.wait(30) == 3
    assert [n["health"] for n in api.nodes() if n["name"] == "a"] == ["offline"]


def test_secrets_reach_only_the_task_and_never_show(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("a")
    r = cli(srv.api, "secret", "set", "db-password", input=SECRET + "\n")
    assert r.returncode == 0, r.stderr
    listed = cli(srv.api, "secret", "ls", "--json").stdout
    assert "db-password" in listed and SECRET not in listed
    # a missing secret is refused at submit, and nothing is stored
    bad = cli(srv.api, "run", "--secret", "nope", "--", "true")
    assert bad.returncode == 1 and "'nope'" in bad.stderr and "podium secret set" in bad.stderr
    assert json.loads(cli(srv.api, "ls", "--json").stdout) == []
    # the task gets it, prints it whole and split across two writes: the stored logs never have it
    script = ('echo "plain: $DB_PASSWORD"; printf "split: %.7s" "$DB_PASSWORD"; sleep 0.3; '
              'printf "%s\\n" "${DB_PASSWORD#???????}"; test -n "$DB_PASSWORD"')
    run = cli(srv.api, "run", "--secret", "db-password:DB_PASSWORD", "--", "sh", "-c", script)
    assert run.returncode == 0, run.stderr
    assert SECRET not in run.stdout and SECRET[:7] not in run.stdout.replace("********", "")
    assert run.stdout.count("********") == 2
    tid = json.loads(cli(srv.api, "ls", "--json").stdout)[0]["id"]
    everything = cli(srv.api, "show", "--json", tid).stdout + cli(srv.api, "logs", tid).stdout
    everything += cluster.api.http.get(f"/v1/tasks/{tid}/logs").text + srv.output()
    assert SECRET not in everything
    # the database holds ciphertext only: a full dump has no plaintext
    assert cluster.db_url
    dump = subprocess.run(["pg_dump", "--data-only", cluster.db_url], capture_output=True, check=True).stdout
    assert SECRET.encode() not in dump and b"db-password" in dump


def test_registry_logins_go_only_with_images_from_that_registry(cluster: Cluster) -> None:
    srv = cluster.server()
    for host, user in (("registry.a.example:5000", "alice"), ("registry.b.example", "bob")):
        r = cli(srv.api, "registry", "login", host, "--username", user, input=f"pw-{user}\n")
        assert r.returncode == 0, r.stderr
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, backends=("container",))
    node.next("welcome")
    api = cluster.api
    # pinned by digest: the server asks no registry before placing it (a tag would be resolved first)
    api.submit(backend="container", image="registry.a.example:5000/team/app@sha256:" + "a" * 64)
    assign = node.next("assign").assign
    assert [(c.registry, c.username, c.password) for c in assign.registries] == [("registry.a.example:5000", "alice", "pw-alice")]
    node.close()
    assert "pw-alice" not in api.http.get("/v1/secrets").text


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_for_the_api_and_the_gateway(cluster: Cluster, tmp_path, mutual: bool) -> None:  # type: ignore[no-untyped-def]
    from tests.tls import make_pki

    pki = make_pki(tmp_path)
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    if mutual:
        args += ["--client-ca", str(pki.ca_cert)]
    srv = cluster.server(extra_args=args, scheme="https", ca_file=pki.ca_cert)
    # the CLI over https, trusting the CA
    r = cli(srv.api, "ls", "--json", extra_env={"PODIUM_CA_FILE": str(pki.ca_cert)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    # plain http is not served
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.api.replace("https", "http") + "/healthz", timeout=5)
    agent_args = ["--ca-file", str(pki.ca_cert)]
    if mutual:
        # an agent without a client certificate is refused, one with it works
        bare = cluster.agent("bare", extra_args=agent_args)
        wait_for(lambda: "refused" in bare.output() or "failed" in bare.output() or "ended" in bare.output(), 30)
        assert not [n for n in cluster.api.nodes() if n["name"] == "bare"]
        bare.stop()
        agent_args += ["--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    cluster.agent("secure", extra_args=agent_args)
    r = cli(srv.api, "run", "--", "echo", "over tls", extra_env={"PODIUM_CA_FILE": str(pki.ca_cert)})
    assert r.returncode == 0 and r.stdout == "over tls\n", r.stderr
