"""Liveness: what keeps a node's lease and its output — heartbeats and log chunks — each flushed in one
statement for every node at once, on a timer, never behind the node reports' backlog.

Heartbeats are recorded over a pool of their own and acknowledged (which renews the node's fence on
its side) only once recorded. Log chunks are stored in arrival order and acknowledged once stored; the
report batcher takes every chunk held (`LogFlusher.taken`) into the transaction that records a batch
of ends, so whoever follows an ended task's output has all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from podium import metrics
from podium.errors import StoreUnavailable
from podium.gateway.sessions import Sessions
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.protocol import fence_after
from podium.store import Store
from podium.timing import Timing

log = logging.getLogger(__name__)

LOG_FLUSH_SECONDS = 0.05

#: (task, fencing token, stream, seq, byte offset, data): one chunk of an attempt's output
Chunk = tuple[uuid.UUID, int, str, int, int, bytes]
LogRow = tuple[uuid.UUID, int, str, int, int, bytes, str]  # a chunk and its node, as `Store.insert_logs` takes it


class Heartbeats:
    """Heartbeats are flushed in one statement per interval, not one per node."""

    def __init__(self, store: Store, sessions: Sessions, timing: Timing, *, server_id: str) -> None:
        self.store = store
        self.sessions = sessions
        self.timing = timing
        self.server_id = server_id
        self.fence_after = fence_after(timing)
        self._beats: dict[str, tuple[int, int]] = {}  # node → (session, latest heartbeat seq)

    def heard(self, node_id: str, session: int, seq: int) -> None:
        self._beats[node_id] = (session, seq)

    async def loop(self) -> None:
        """Heartbeats are flushed in one statement per interval, not one per node."""
        interval = max(0.05, self.timing.heartbeat / 4)
        while True:
            await asyncio.sleep(interval)
            beats, self._beats = self._beats, {}
            if not beats:
                continue
            try:
                with metrics.HEARTBEAT_FLUSH_SECONDS.time():
                    recorded = await self.store.heartbeats([(n, sess) for n, (sess, _seq) in beats.items()], self.server_id)
            except StoreUnavailable as e:
                # not acknowledged: the nodes' leases are not renewed, which is the truth
                log.warning("heartbeats not recorded: %s", e)
                continue
            # a heartbeat not recorded came on a session that is no longer the node's (or from a node
            # removed from the fleet): it renews nothing and is not acknowledged
            now = asyncio.get_running_loop().time()
            for node_id, (sess, seq) in beats.items():
                if node_id not in recorded:
                    continue
                s = self.sessions.get(node_id)
                # An ack renews the node's lease for fence_after from that heartbeat; acking every
                # one would be thousands of writes a second on a large fleet for no gain, so a node
                # is acked when its last ack is a quarter of the lease old.
                if s is not None and s.session == sess and now - s.last_ack >= self.fence_after / 4:
                    s.last_ack = now
                    s.send(pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq)))


class LogFlusher:
    def __init__(self, store: Store, sessions: Sessions) -> None:
        self.store = store
        self.sessions = sessions
        # node → chunks received and not yet stored, in arrival order
        self._logs: dict[str, list[Chunk]] = {}
        # One flush at a time: a chunk put back after a failed flush is stored (and acknowledged)
        # before any that came after it, and a flush that returns has stored all received before it.
        self._lock = asyncio.Lock()

    def add(self, node_id: str, chunk: Chunk) -> None:
        self._logs.setdefault(node_id, []).append(chunk)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(LOG_FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> bool:
        """Store the log chunks of every node received since the last flush, in one statement.
        False if they could not be stored (they are kept, in order, for the next flush)."""
        async with self._lock:
            return await self._flush()

    async def _flush(self) -> bool:
        pending, self._logs = self._logs, {}
        if not pending:
            return True
        try:
            await self.store.insert_logs(_rows(pending))
        except StoreUnavailable as e:
            log.warning("logs from %d nodes not stored yet: %s", len(pending), e)
            self._keep(pending)
            return False
        self._stored(pending)
        return True

    @contextlib.asynccontextmanager
    async def taken(self) -> AsyncIterator[list[LogRow]]:
        """Every chunk received so far, for the caller to store in a transaction of its own (the
        group commit of the ends they came before): acknowledged to their nodes once the block ends,
        kept for the next flush, ahead of any received since, if it raises. No flush runs meanwhile."""
        async with self._lock:
            pending, self._logs = self._logs, {}
            try:
                yield _rows(pending)
            except BaseException:
                self._keep(pending)
                raise
            self._stored(pending)

    def _keep(self, pending: dict[str, list[Chunk]]) -> None:
        for node_id, chunks in pending.items():
            self._logs[node_id] = chunks + self._logs.get(node_id, [])

    def _stored(self, pending: dict[str, list[Chunk]]) -> None:
        """Stored: the nodes may forget them (until now each keeps them, to send again if we die)."""
        for node_id, chunks in pending.items():
            s = self.sessions.get(node_id)
            if s is None:
                continue
            upto: dict[tuple[uuid.UUID, int, str], int] = {}
            for tid, token, stream, seq, _offset, _data in chunks:
                key = (tid, token, stream)
                upto[key] = max(upto.get(key, -1), seq)
            for (tid, token, stream), seq in upto.items():
                s.send(pb.ServerMessage(log_ack=pb.LogAck(task_id=str(tid), fencing_token=token, stream=stream, seq=seq)))


def _rows(pending: dict[str, list[Chunk]]) -> list[LogRow]:
    return [(*c, node_id) for node_id, chunks in pending.items() for c in chunks]
