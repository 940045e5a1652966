"""gRPC's asyncio completions, handed to a busy event loop all at once instead of one a loop turn.

grpc.aio (grpcio 1.85) learns of finished operations — a message read, a write done — from a thread
that waits on the C core's completion queue. For each one it queues the event and writes one byte
to a socket pair whose other end the event loop watches; the loop's reader then takes *every*
queued event, but reads only one byte. A loop that takes many events per turn therefore leaves a
byte behind for each, and once the socket's buffer is full (~280 one-byte writes on Linux: each is a
buffer of its own) the thread blocks in that write: from then on one completion reaches the loop per
turn of the loop, whatever the C core has finished.

A loop busy elsewhere turns slowly. The server's, taking a flood of submissions (6,000-13,000
tasks a second in batches of 100), turned a few dozen times a second, and for the flood's length no
Assign reached its node and no report or heartbeat was read (every write to a stream waited for the
flood's end), though the dispatcher had placed thousands: 3-4 s for 30,000 tasks, 22 s for 150,000,
whose first acceptances were then read after their deadline and their tasks placed again
(docs/benchmarks.md, issue 17, thirtieth session). An agent running many short commands is the same
kind of loop.

`drain_wakeups()` makes that socket's reads take every byte there is: each completion still wakes
the loop, and the thread never blocks. It changes the socket pair grpc makes for its queue and
nothing else: grpc's module looks `socket.socketpair` up by name when it makes one, so it is given a
module of its own whose `socketpair` wraps the standard one (every other name is the standard
module's). A grpc without that lookup (a later one, perhaps with this mended) is left as it is.
Call it before the process's first gRPC object; calling it again does nothing.
"""

from __future__ import annotations

import logging
import socket
import types
from typing import Any

log = logging.getLogger(__name__)

# what one read of the wake-up socket takes at most: far more than a loop's turn ever leaves there
DRAIN_BYTES = 65536


class _DrainingSocket(socket.socket):
    """The loop's end of grpc's wake-up socket pair: a read takes every byte waiting, not the one asked for."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        try:
            return super().recv(max(bufsize, DRAIN_BYTES), flags)
        except BlockingIOError:
            # nothing waiting (another reader took it): the caller takes the queued events all the same
            return b""


def _socketpair(*args: Any, **kwargs: Any) -> tuple[socket.socket, socket.socket]:
    read_end, write_end = socket.socketpair(*args, **kwargs)
    drained = _DrainingSocket(read_end.family, read_end.type, read_end.proto, fileno=read_end.detach())
    # grpc reads it only when the loop says it is readable; non-blocking, a read that finds nothing
    # (read already by this same turn) cannot hold the loop
    drained.setblocking(False)
    return drained, write_end


def _socket_module() -> types.ModuleType:
    shim = types.ModuleType("socket", "the standard socket module, with a socket pair whose reads drain it")
    shim.__dict__["__getattr__"] = lambda name: getattr(socket, name)  # every other name: the real module's
    shim.__dict__["socketpair"] = _socketpair
    return shim


def drain_wakeups() -> bool:
    """Give grpc's completion queues a wake-up socket that each read empties. True if this grpc
    takes it (or already has it), False if it makes its socket pairs some other way."""
    try:
        from grpc._cython import cygrpc
    except ImportError:  # pragma: no cover - grpcio is a dependency
        return False
    current = getattr(cygrpc, "socket", None)
    if isinstance(current, types.ModuleType) and current.__dict__.get("socketpair") is _socketpair:
        return True
    if current is not socket:
        log.debug("grpc's module makes its wake-up sockets some other way; left as it is")
        return False
    cygrpc.socket = _socket_module()
    return True
