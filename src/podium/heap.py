"""What a long-running process built at startup, kept out of the cyclic garbage collector's sight,
and how often the collector looks at what is made after.

A full collection traverses every container object the process holds. A server holds ~110,000 once
started (modules, classes, the API's routes and models, generated protobuf code) and an agent ~51,000,
nearly all of which live as long as the process; each full collection of a server took 100-270 ms of
its one event loop on a two-core machine under load, every Assign, acceptance and heartbeat
waiting behind it (docs/benchmarks.md, issue 17). Frozen, they are never traversed again, and a full
collection looks only at what was made since: 6-50 ms.

What is made since is not small on a server with a fleet: each node's stream holds ~100 objects
(its coroutines, tasks, futures, gRPC's call state), ~500,000 for 5,000 nodes. With the default
young threshold (700 objects), a report, an Assign or a request that lived through two young
collections — a few milliseconds on a busy server — was promoted to the oldest generation, and the
oldest generation was collected again whenever those had grown it by a quarter: every second or so,
each collection a walk of every stream's objects (~230 ms). The server of the simulated 5,000-node
fleet spent 31-34 s of its 84-91 s of CPU in the collector. A young generation of YOUNG objects lets
those die young (a young collection then takes a few milliseconds, and comes that much more rarely):
9.2-9.8 s of 65-70 s.
"""

from __future__ import annotations

import gc

# Container objects allocated (net of those freed) between two young collections; Python's default
# is 700. 50,000 shortened the collector's total further (5.6 s in one run) but each young
# collection then held the event loop ~33 ms, against ~5 ms at this size.
YOUNG = 10_000


def freeze_startup() -> None:
    """Collect what startup left behind (garbage frozen would never be freed), then freeze the rest,
    and let the young generation grow to YOUNG objects. Called once a process has built everything it
    keeps; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
