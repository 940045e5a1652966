"""The facts of the agent protocol that both ends must agree on, defined once: the server's gateway
and the agent import them from here (the agent never imports the gateway, the store or the loops).

Pure: no I/O, no clock, no generated protobuf code (event kinds are named as the proto names them;
each side maps the names to its own representation).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from podium.timing import Timing

M = TypeVar("M")

#: The agent protocol versions this build speaks, both as a server and as an agent.
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1

# Event kinds as the node sends them (podium.v1 TaskEvent.Kind), by name.
PROVISIONING = "PROVISIONING"
RUNNING = "RUNNING"
EXITED = "EXITED"
FAILED_RETRYABLE = "FAILED_RETRYABLE"
NOT_RUNNING = "NOT_RUNNING"

#: The reports that end an attempt on the node: the agent keeps each until the server acknowledges
#: it (re-sending it on every reconnect), and the server stores the attempt's output before it.
FINAL_KINDS = frozenset({EXITED, FAILED_RETRYABLE, NOT_RUNNING})


#: A batch (AgentBatch, ServerBatch) holds at most this many messages, and stops growing once the
#: next message would take it past this many bytes: far below gRPC's 4 MiB message limit, which a
#: single message of its own (a 64 KiB log chunk, an Assign) never comes near.
BATCH_MAX_MESSAGES = 256
BATCH_MAX_BYTES = 1 << 20


def take_batch(queue: asyncio.Queue[M | None], first: M, size: Callable[[M], int]) -> tuple[list[M], M | None, bool]:
    """`first` and whatever else a stream's writer finds queued right now, in order, within the batch
    limits: (the batch, a message taken that did not fit — to be written next, None if none, whether
    the queue's end (None) was taken). Never waits: a writer that finds one message writes one."""
    batch, total = [first], size(first)
    while len(batch) < BATCH_MAX_MESSAGES and not queue.empty():
        msg = queue.get_nowait()
        if msg is None:
            return batch, None, True
        n = size(msg)
        if total + n > BATCH_MAX_BYTES:
            return batch, msg, False
        batch.append(msg)
        total += n
    return batch, None, False


def fence_after(timing: Timing) -> float:
    """How long after its last acknowledged heartbeat a node stops its attempts by itself (its fence
    deadline, sent in the Welcome): two heartbeats before the server may declare it offline and give
    its work away — and never less than half of OfflineAfter, so a heartbeat set long against
    OfflineAfter cannot leave a node no lease at all."""
    return max(timing.offline_after - 2 * timing.heartbeat, timing.offline_after / 2)


def handover_after(timing: Timing) -> float:
    """After another agent instance takes a node over, how long past the old instance's last recorded
    heartbeat the attempts it does not report stay the node's: the old instance's fence deadline
    (which runs from when it *sent* that heartbeat, earlier) plus a heartbeat for its fence keeper to
    act."""
    return fence_after(timing) + timing.heartbeat
