"""A node's acceptance (its `provisioning`: it starts the task only once told it is recorded), against
a real server: made as expected when the task is assigned to that node under that token, and decided
on what the task's row holds when it is not — a token the node was never given is refused and that
attempt stopped, an acceptance said again is answered again without a second write, and a task
cancelled before its node accepted it is not accepted. Real server, real PostgreSQL, a node driven
by hand over the real protocol."""

from __future__ import annotations

import uuid

from podium.proto.podium.v1 import agent_pb2 as pb
from tests.acceptance.conftest import Cluster
from tests.harness import Api
from tests.protocol_node import ProtocolNode

K = pb.TaskEvent.Kind


def _event(tid: str, token: int, kind: int) -> pb.AgentMessage:
    return pb.AgentMessage(event=pb.TaskEvent(task_id=tid, fencing_token=token, kind=kind))


def _provisioning_events(api: Api, tid: str) -> int:
    task = api.task(tid)
    return sum(1 for e in task["events"] if e["to_state"] == "provisioning")


def test_an_acceptance_its_task_does_not_confirm_is_decided_on_what_the_task_holds(cluster: Cluster) -> None:
    # Timers as in production (accept deadline 15 s): both tasks stay assigned, unaccepted, through
    # several round trips here, which tenfold timers (1.5 s) would not wait for on a busy machine.
    srv = cluster.server(extra_env={"PODIUM_TEST_TIMER_DIVISOR": "1"})
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, batches=True, heartbeat=1.0)
    try:
        node.next("welcome")
        api = cluster.api
        a, b = api.submit_batch({"command": ["true"]}, {"command": ["true"]})  # one submission: both answered in time
        tokens: dict[str, int] = {}
        while len(tokens) < 2:
            asg = node.next("assign").assign
            tokens[asg.task_id] = asg.fencing_token
        assert set(tokens) == {a, b}

        # a token this node was never given: refused, and the node told to stop whatever runs under it
        node.send(_event(a, tokens[a] + 1000, K.PROVISIONING))
        sent = node.until(lambda m: m.WhichOneof("kind") == "cancel")
        assert (sent[-1].cancel.task_id, sent[-1].cancel.fencing_token, sent[-1].cancel.reason) == (
            a, tokens[a] + 1000, "stale attempt"
        )  # fmt: skip
        assert not [m for m in sent if m.WhichOneof("kind") == "accepted"]
        assert api.task(a)["state"] == "assigned"

        # its own token: recorded, and answered
        node.send(_event(a, tokens[a], K.PROVISIONING))
        assert node.next("accepted").accepted.task_id == a
        recorded = api.wait_state(a, "provisioning", 30)
        assert _provisioning_events(api, a) == 1

        # said again (as after a reconnect): answered again, and nothing written twice
        node.send(_event(a, tokens[a], K.PROVISIONING))
        again = node.next("accepted").accepted
        assert (again.task_id, again.fencing_token) == (a, tokens[a])
        assert api.task(a)["revision"] == recorded["revision"] and _provisioning_events(api, a) == 1

        # b cancelled before its node accepted it: its acceptance is not recorded and not answered
        assert api.http.post(f"/v1/tasks/{b}/cancel").status_code == 200
        assert node.next("cancel").cancel.task_id == b
        node.send(_event(b, tokens[b], K.PROVISIONING))
        node.send(_event(b, tokens[b], K.NOT_RUNNING))  # then, as the node would: it has nothing of b
        # b's acceptance is settled no later than its end, whose Ack follows it on the stream
        sent = node.until(lambda m: m.WhichOneof("kind") == "ack" and m.ack.task_id == b)
        assert not [m for m in sent if m.WhichOneof("kind") == "accepted"], [m.WhichOneof("kind") for m in sent]
        ended = api.wait_state(b, "cancelled", 30)
        assert _provisioning_events(api, b) == 0 and ended["attempt_list"][-1]["provisioning_at"] is None
    finally:
        node.close()


def test_a_running_is_recorded_with_the_lease_its_tasks_timeout_gives(cluster: Cluster) -> None:
    """A `running` whose Assign the stream carried is made on the row it expects (one round trip):
    its lease is still the task's own timeout plus grace, or none with no timeout, and a `running`
    under a token the node was never given is still refused and stopped."""
    from datetime import datetime

    srv = cluster.server(extra_env={"PODIUM_TEST_TIMER_DIVISOR": "1"})  # grace 60 s, as in production
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, batches=True, heartbeat=1.0)
    try:
        node.next("welcome")
        api = cluster.api
        timed, untimed = api.submit_batch({"command": ["true"], "timeout": 600}, {"command": ["true"]})
        tokens: dict[str, int] = {}
        while len(tokens) < 2:
            asg = node.next("assign").assign
            tokens[asg.task_id] = asg.fencing_token
        for tid in (timed, untimed):
            node.send(_event(tid, tokens[tid], K.PROVISIONING))
            assert node.next("accepted").accepted.task_id == tid
            api.wait_state(tid, "provisioning", 30)

        # a token this node was never given: refused, and what runs under it stopped
        node.send(_event(timed, tokens[timed] + 1000, K.RUNNING))
        sent = node.until(lambda m: m.WhichOneof("kind") == "cancel")
        assert (sent[-1].cancel.task_id, sent[-1].cancel.fencing_token) == (timed, tokens[timed] + 1000)
        assert api.task(timed)["state"] == "provisioning"

        for tid in (timed, untimed):
            node.send(_event(tid, tokens[tid], K.RUNNING))
        t = api.wait_state(timed, "running", 30)
        started = datetime.fromisoformat(t["attempt_list"][-1]["started_at"])
        lease = datetime.fromisoformat(t["lease_expires_at"]) - started
        assert 600 + 60 - 5 <= lease.total_seconds() <= 600 + 60 + 5, lease  # the timeout plus grace
        u = api.wait_state(untimed, "running", 30)
        assert u["lease_expires_at"] is None  # held while its node is healthy
        assert [e["to_state"] for e in t["events"]] == ["queued", "assigned", "provisioning", "running"]
    finally:
        node.close()
