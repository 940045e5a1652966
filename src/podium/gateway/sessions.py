"""The streams this replica holds, one per node, and what a (re)connecting node's Hello means.

`Sessions` is the one map of node → stream; it also hears the removals and takeovers other replicas
announce (podium_revoked, podium_superseded) and closes the streams they end. `Reconciler` squares a
Hello's list of attempts with the store's: keep, stop, redeliver, or apply the node-loss policy.
Every change it makes goes through the policy and the one applier; none is made from memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field

from podium import protocol, reasons
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.protocol import FINAL_KINDS, PROTOCOL_MAX, PROTOCOL_MIN
from podium.scheduler import policy
from podium.scheduler.apply import Applier, facts
from podium.states import TaskState
from podium.store import Store
from podium.store.rows import NodeTaskRow
from podium.timing import Timing

log = logging.getLogger(__name__)

MAX_TIMEOUTS_KEPT = 65536  # Assigns whose timeouts one stream remembers at most (Session.timeouts)


@dataclass(eq=False, slots=True)
class Pending:
    """A node's report waiting for the next group commit."""

    event: pb.TaskEvent
    task_id: uuid.UUID
    kind: str
    tries: int = 0
    received: float = 0.0  # loop time the gateway read it (how far behind the group commits are)

    @property
    def final(self) -> bool:
        return self.kind in FINAL_KINDS


@dataclass(eq=False)
class Session:
    node_id: str
    session: int
    out: asyncio.Queue[pb.ServerMessage | None] = field(default_factory=asyncio.Queue)
    revoked: bool = False
    last_ack: float = float("-inf")  # loop time of the last HeartbeatAck sent
    events: deque[Pending] = field(default_factory=deque)  # reports in arrival order, not yet applied
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set while the backlog is below the limit
    instance_id: str = ""  # the agent process on the other end ("" from an agent too old to say)
    batches: bool = False  # the agent reads ServerBatch (its Hello said so); an older one is sent one by one
    # The timeout of each task this stream carried an Assign for, by fencing token, until its `running`
    # is settled: what the policy needs to decide that `running` on the row it expects (the lease is
    # the timeout plus grace) without reading it. A spec never changes, so this is what a read would
    # say; a token not here (an Assign another replica, or an earlier stream, delivered) is read.
    timeouts: dict[int, float | None] = field(default_factory=dict)
    # monotonic time the stream's write in progress began (None while none is): what is queued behind
    # it waits at least that long, and an Assign among it is that late to its node
    writing_since: float | None = None

    def carried(self, token: int, timeout: float | None) -> None:
        if len(self.timeouts) >= MAX_TIMEOUTS_KEPT:
            self.timeouts.clear()  # attempts that never said `running` (cancelled, revoked): read instead
        self.timeouts[token] = timeout

    def send(self, msg: pb.ServerMessage) -> None:
        self.out.put_nowait(msg)

    def close(self) -> None:
        self.out.put_nowait(None)


def accepted(s: Session, task_id: str, token: int) -> None:
    """Tell the node its provisioning is recorded: it may start the attempt."""
    s.send(pb.ServerMessage(accepted=pb.Accepted(task_id=task_id, fencing_token=token)))


def streams_behind(ages: list[float]) -> float:
    """How far behind the streams are: the age of the write in progress that more than a quarter of
    them have been in for at least as long (0 for a stream writing nothing). Not the slowest one: a
    single node that stops reading must not hold placement on the whole fleet. With one stream, its own."""
    if not ages:
        return 0.0
    writing = sorted((a for a in ages if a > 0.0), reverse=True)
    k = len(ages) // 4
    return writing[k] if k < len(writing) else 0.0


class Sessions(dict[str, Session]):
    """node id → the stream this replica holds for it (at most one)."""

    def on_revoked(self, node_id: str) -> None:
        s = self.get(node_id)
        if s is not None:
            log.warning("node %s was removed from the fleet; closing its stream", node_id)
            s.revoked = True
            s.close()

    def on_superseded(self, payload: str) -> None:
        """Another instance said Hello for a node, maybe on another replica: if this replica holds the
        old instance's stream, tell it so and close it. (A missed notification is safe: the old
        stream's heartbeats no longer match the node's session, so nothing renews its lease, and it
        fences itself by its deadline; the server waits for that deadline before giving its work away.)"""
        try:
            note = json.loads(payload)
            node_id, old, new = note["node"], note["old"], note["new"]
        except (ValueError, KeyError, TypeError):
            log.warning("malformed podium_superseded notification %r", payload)
            return
        s = self.get(node_id)
        if s is not None and s.instance_id == old:
            self.supersede(s, new)

    def supersede(self, s: Session, new_instance: str) -> None:
        log.warning("node %s: agent instance %s was superseded by instance %s; telling it to stop", s.node_id, s.instance_id, new_instance)
        s.send(pb.ServerMessage(superseded=pb.Superseded(reason=reasons.SUPERSEDED, instance_id=new_instance)))
        s.close()


class Reconciler:
    def __init__(self, store: Store, applier: Applier, timing: Timing) -> None:
        self.store = store
        self.applier = applier
        self.timing = timing

    async def reconcile(self, s: Session, hello: pb.Hello) -> None:
        """A (re)connecting node says what it still runs. Keep what is still its own, stop what is not,
        redeliver what it never received, and apply the node-loss policy to what it no longer has."""
        reported = {(rt.task_id, rt.fencing_token): rt for rt in hello.tasks}
        reported_tokens = {tok for (_t, tok) in reported}
        on_server = await self.store.tasks_on_node(s.node_id)
        current = {r.fencing_token for r in on_server}
        stale = [tok for tok in reported_tokens if tok not in current]
        if stale:
            # Still running something that is no longer its attempt: the server's truth wins.
            await self.store.request_stop(s.node_id, stale)
            for (tid, tok), rt in reported.items():
                if tok in stale and rt.phase != "exited":
                    s.send(pb.ServerMessage(cancel=pb.Cancel(task_id=tid, fencing_token=tok, reason="stale attempt")))
        redeliver = []
        gone: list[NodeTaskRow] = []  # on the node by the server's word, not in this Hello
        for r in on_server:
            if r.fencing_token in reported_tokens:
                phase = reported[(str(r.id), r.fencing_token)].phase if (str(r.id), r.fencing_token) in reported else ""
                if phase in ("provisioning", "running"):
                    # events sent on the old stream may have been lost with it: catch up from the report
                    for kind in (protocol.PROVISIONING, protocol.RUNNING)[: 1 if phase == "provisioning" else 2]:
                        row = await self.store.get_task(r.id)
                        f = facts(row)
                        await self.applier.apply(r.id, f.state, policy.on_node_event(f, kind, None, self.timing),
                                                   actor=f"node:{s.node_id}", fencing_token=r.fencing_token, node_id=s.node_id)
                    row = await self.store.get_task(r.id)
                    if row.state in ACCEPTED and row.fencing_token == r.fencing_token:
                        accepted(s, str(r.id), r.fencing_token)  # it may be waiting for this
                if r.state == TaskState.CANCELLING:
                    s.send(pb.ServerMessage(cancel=pb.Cancel(
                        task_id=str(r.id), fencing_token=r.fencing_token, reason=reasons.CANCELLED)))  # fmt: skip
                continue
            gone.append(r)
        # While another instance that may still run them has not passed its fence deadline (the
        # node was just taken over), what this one does not report is neither redelivered nor given
        # away: the watchdog applies the node-loss policy once that deadline has passed. Assignments
        # never pushed to any stream are no other instance's: they go to this one as usual.
        if gone:
            fresh = await self.store.undelivered_on_node(s.node_id)
            held = [r.fencing_token for r in gone if r.fencing_token not in fresh]
            if held and await self.store.defer_node_loss(s.node_id, held):
                log.warning("node %s: %d attempts wait for the fence deadline of the instance this one superseded", s.node_id, len(held))
                gone = [r for r in gone if r.fencing_token in fresh]
        for r in gone:
            if r.state == TaskState.ASSIGNED:
                redeliver.append(r.fencing_token)
                continue
            row = await self.store.get_task(r.id)
            f = facts(row)
            step = policy.on_node_loss(f, reasons.NODE_FORGOT)
            await self.applier.apply(
                r.id, f.state, step, actor=f"node:{s.node_id}", fencing_token=r.fencing_token, node_id=s.node_id
            )
        await self.store.redeliver(redeliver)


ACCEPTED = (TaskState.PROVISIONING, TaskState.RUNNING)


def egress_of(h: pb.Hello) -> list[str]:
    """The egress contexts a node declared; one that declares none has what any process has."""
    return sorted(set(h.egress_contexts)) or ["open"]


def check_hello(h: pb.Hello) -> str | None:
    if not h.node_id or len(h.node_id) > 128:
        return "Hello needs a node_id of 1 to 128 characters"
    if len(h.instance_id) > 256:
        return "Hello's instance_id must be at most 256 characters"
    if h.protocol_max and h.protocol_max < PROTOCOL_MIN or (h.protocol_min or 1) > PROTOCOL_MAX:
        return f"this server speaks agent protocol {PROTOCOL_MIN}..{PROTOCOL_MAX}; the agent speaks {h.protocol_min}..{h.protocol_max}"
    c = h.capacity
    if min(c.cpu_millis, c.memory_bytes, c.disk_bytes, c.gpus, c.slots) < 0:
        return "capacity values must be non-negative"
    return None
