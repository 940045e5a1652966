"""Every long-running Podium process runs on uvloop's event loop (issue 17: less CPU per task): the
server, `podium dev` and the agent, whose task processes then start, stream and end on it as they do
on asyncio's."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import uvloop

from podium.agent.backends import FAILURE_CANCELLED
from podium.cli import launch
from podium.eventloop import run_loop
from tests.integration import test_process_backend_adapter as adapter


def test_a_process_runs_its_coroutine_on_uvloop() -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(run_loop(loop_type()), uvloop.Loop)


def test_the_server_dev_and_agent_commands_use_it() -> None:
    for command in (launch.server, launch.dev, launch.agent):
        source = inspect.getsource(command)
        assert "run_loop(main())" in source and "asyncio.run(" not in source, command.__name__


def test_an_agents_task_processes_run_on_it(tmp_path: Path) -> None:
    """The process backend's own tests, on uvloop as the agent runs them: a command's output and exit
    code (its pipes and its exit watched by readers on the loop); a stop that sends SIGTERM to the
    process group and SIGKILL after the grace."""

    async def on_uvloop(test: Coroutine[Any, Any, None]) -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        await test

    run_loop(on_uvloop(adapter.test_output_exit_code_and_proof(tmp_path / "a")))
    run_loop(on_uvloop(adapter.test_stop_is_sigterm_then_sigkill_after_the_grace(tmp_path / "b", FAILURE_CANCELLED)))
