"""The event loop a long-running Podium process (a server, `podium dev`, an agent) runs on.

uvloop's, where it has a build: these processes are gRPC, HTTP and asyncpg turns, and uvloop runs
those turns (and asyncpg's protocol) for less CPU than asyncio's own loop (docs/benchmarks.md, issue
17). An agent too: it starts its tasks' processes with `subprocess.Popen` itself and watches their
exits and pipes with readers on the loop, so nothing is forked by libuv (which would copy the whole
agent for each task: the reason the agent once stayed on asyncio's loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a process's main coroutine to its end on uvloop's event loop (asyncio's where uvloop has
    no build, e.g. Windows: the same work, for more CPU)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
