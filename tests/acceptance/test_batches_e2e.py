"""Several protocol messages in one write, against a real server: a node's batch is handled as if
each message had come on its own, in its order (an end's output stored before the end), and a node
that does not say it reads batches is never sent one. Real server, real PostgreSQL, a node driven by
hand over the real protocol."""

from __future__ import annotations

import uuid

from podium.proto.podium.v1 import agent_pb2 as pb
from tests.acceptance.conftest import Cluster
from tests.harness import wait_for
from tests.protocol_node import ProtocolNode

K = pb.TaskEvent.Kind


def _event(tid: str, token: int, kind: int, exit_code: int = 0) -> pb.AgentMessage:
    return pb.AgentMessage(event=pb.TaskEvent(task_id=tid, fencing_token=token, kind=kind, exit_code=exit_code))


def test_a_batch_from_a_node_is_applied_in_its_order_with_the_output_before_the_end(cluster: Cluster) -> None:
    srv = cluster.server()
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, batches=True, heartbeat=1.0)
    try:
        assert node.next("welcome").welcome.batches  # this server takes batches
        api = cluster.api
        tids = set(api.submit_batch(*[{"command": ["true"]}] * 3))  # one submission: each is answered in time
        assigns = {}
        while len(assigns) < len(tids):
            a = node.next("assign").assign
            assigns[a.task_id] = a.fencing_token
        assert set(assigns) == tids
        # every provisioning in one write: each is recorded, and each is answered with its Accepted
        node.send(pb.AgentMessage(batch=pb.AgentBatch(messages=[_event(t, tok, K.PROVISIONING) for t, tok in assigns.items()])))
        accepted = {node.next("accepted").accepted.task_id for _ in tids}
        assert accepted == tids
        # the three were applied in one group commit, whose answers go out in one write
        assert node.batches_received >= 1
        # running, the output and the end of one task, and the end of another, in one write
        (t1, k1), (t2, k2), (t3, k3) = sorted(assigns.items())
        chunk = pb.LogChunk(task_id=t1, fencing_token=k1, stream="stdout", seq=0, offset=0, data=b"out of a batch\n")
        node.send(pb.AgentMessage(batch=pb.AgentBatch(messages=[
            _event(t1, k1, K.RUNNING), pb.AgentMessage(log=chunk), _event(t1, k1, K.EXITED, 0),
            _event(t2, k2, K.RUNNING), _event(t2, k2, K.EXITED, 3),
            # never a Hello inside a batch: ignored, and the rest still applied
            pb.AgentMessage(hello=pb.Hello(node_id="someone-else")),
            _event(t3, k3, K.RUNNING),
        ])))  # fmt: skip
        assert api.wait_state(t1, "succeeded", 30)["exit_code"] == 0
        assert api.wait_state(t2, "failed", 30)["exit_code"] == 3
        api.wait_state(t3, "running", 30)
        logs = api.http.get(f"/v1/tasks/{t1}/logs").json()["chunks"]
        assert "".join(c["data"] for c in logs) == "out of a batch\n"
        acked = {node.next("ack").ack.task_id for _ in range(2)}
        assert acked == {t1, t2}
    finally:
        node.close()


def test_a_short_commands_running_and_end_in_one_write_are_one_change(cluster: Cluster) -> None:
    """A command that ended before its `running` was sent: the node writes both at once, and the server
    writes the task once (its revision moves by one), with both events in order, the attempt's start,
    end and process group, and one Ack."""
    srv = cluster.server()
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, batches=True, heartbeat=1.0)
    try:
        node.next("welcome")
        api = cluster.api
        tid = api.submit(command=["true"])["id"]
        a = node.next("assign").assign
        assert a.task_id == tid
        node.send(_event(tid, a.fencing_token, K.PROVISIONING))
        assert node.next("accepted").accepted.task_id == tid
        before = api.wait_state(tid, "provisioning", 30)
        running = pb.TaskEvent(task_id=tid, fencing_token=a.fencing_token, kind=K.RUNNING, backend_ref="4242")
        node.send(pb.AgentMessage(batch=pb.AgentBatch(messages=[
            pb.AgentMessage(event=running), _event(tid, a.fencing_token, K.EXITED, 0),
        ])))  # fmt: skip
        after = api.wait_state(tid, "succeeded", 30)
        assert after["revision"] == before["revision"] + 1
        assert [(e["from_state"], e["to_state"]) for e in after["events"]][-2:] == [
            ("provisioning", "running"), ("running", "succeeded")
        ]  # fmt: skip
        attempt = after["attempt_list"][-1]
        assert (attempt["state"], attempt["exit_code"], attempt["backend_ref"]) == ("exited", 0, "4242")
        assert attempt["started_at"] is not None and attempt["finished_at"] >= attempt["started_at"]
        assert node.next("ack").ack.task_id == tid
    finally:
        node.close()


def test_a_node_that_does_not_say_it_reads_batches_is_sent_every_message_on_its_own(cluster: Cluster) -> None:
    srv = cluster.server()
    join = srv.data_dir.joinpath("join-token").read_text().strip()
    node = ProtocolNode(srv.grpc, f"n-{uuid.uuid4().hex[:8]}", join, heartbeat=1.0, slots=8)
    try:
        node.next("welcome")
        api = cluster.api
        tids = set(api.submit_batch(*[{"command": ["true"]}] * 5))  # one submission: each is answered in time
        assigns = {}
        while len(assigns) < len(tids):
            a = node.next("assign").assign
            assigns[a.task_id] = a.fencing_token
        for t, tok in assigns.items():
            node.event(t, tok, K.PROVISIONING)
        wait_for(lambda: all(api.task(t)["state"] == "provisioning" for t in tids), 30, what=str([api.task(t)["state"] for t in tids]))
        for _ in tids:
            node.next("accepted")
        assert node.batches_received == 0
    finally:
        node.close()
