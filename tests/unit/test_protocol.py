"""The protocol facts both ends share (podium.protocol): each defined once, each what the proto and
the seeds say."""

from __future__ import annotations

from podium import protocol
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.timing import DEFAULT_TIMING, Timing


def test_every_kind_named_is_a_kind_of_the_proto() -> None:
    names = set(pb.TaskEvent.Kind.keys())
    for kind in (protocol.PROVISIONING, protocol.RUNNING, *protocol.FINAL_KINDS):
        assert kind in names
    # the reports an agent keeps until acknowledged are exactly the ends, never progress
    assert {"EXITED", "FAILED_RETRYABLE", "NOT_RUNNING"} == protocol.FINAL_KINDS


def test_the_fence_deadline_is_two_heartbeats_before_offline() -> None:
    t = DEFAULT_TIMING
    assert protocol.fence_after(t) == t.offline_after - 2 * t.heartbeat == 100.0
    assert protocol.handover_after(t) == protocol.fence_after(t) + t.heartbeat


def test_a_long_heartbeat_still_leaves_a_node_half_of_offline_after() -> None:
    t = Timing(heartbeat=50.0, offline_after=120.0)
    assert protocol.fence_after(t) == 60.0  # not 20: a node is never fenced almost at once
    assert 0 < protocol.fence_after(t) < t.offline_after


def test_the_agent_and_the_gateway_speak_the_same_range() -> None:
    assert 1 <= protocol.PROTOCOL_MIN <= protocol.PROTOCOL_MAX
