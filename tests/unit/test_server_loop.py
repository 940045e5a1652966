"""The server's process runs on uvloop's event loop (issue 17: less CPU per task); the agent does not."""

from __future__ import annotations

import asyncio
import inspect

import uvloop

from podium.cli import launch
from podium.server import run_server_loop


def test_a_server_process_runs_its_coroutine_on_uvloop() -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(run_server_loop(loop_type()), uvloop.Loop)


def test_the_server_commands_use_it_and_the_agent_keeps_asyncio() -> None:
    # libuv would fork the agent's task processes in full (docs/benchmarks.md, issue 17)
    assert "run_server_loop(main())" in inspect.getsource(launch.server)
    assert "run_server_loop(main())" in inspect.getsource(launch.dev)
    assert "run_server_loop" not in inspect.getsource(launch.agent)
