"""What a long-running process built at startup, kept out of the cyclic garbage collector's sight.

A full collection traverses every container object the process holds. A server holds ~110,000 once
started (modules, classes, the API's routes and models, generated protobuf code) and an agent ~51,000,
nearly all of which live as long as the process; each full collection of a server took 100-270 ms of
its one event loop on a two-core machine under load, every Assign, acceptance and heartbeat
waiting behind it (docs/benchmarks.md, issue 17). Frozen, they are never traversed again, and a full
collection looks only at what was made since: 6-50 ms.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """Collect what startup left behind (garbage frozen would never be freed), then freeze the rest.
    Called once a process has built everything it keeps; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
