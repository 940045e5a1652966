"""Every long-running Podium process runs on uvloop's event loop (issue 17: less CPU per task): the
server, `podium dev` and the agent, whose task processes then start, stream and end on it as they do
on asyncio's."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from pathlib import Path

import uvloop

from podium.agent.backends import FAILURE_CANCELLED, FAILURE_EXIT, RunSpec
from podium.agent.backends.process import ProcessBackend
from podium.cli import launch
from podium.eventloop import run_loop


def test_a_process_runs_its_coroutine_on_uvloop() -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(run_loop(loop_type()), uvloop.Loop)


def test_the_server_dev_and_agent_commands_use_it() -> None:
    for command in (launch.server, launch.dev, launch.agent):
        source = inspect.getsource(command)
        assert "run_loop(main())" in source and "asyncio.run(" not in source, command.__name__


class Output:
    def __init__(self) -> None:
        self.data = {"stdout": b"", "stderr": b""}

    async def __call__(self, stream: str, data: bytes) -> None:
        self.data[stream] += data


def test_an_agents_task_processes_run_on_it(tmp_path: Path) -> None:
    """On uvloop, as the agent runs them: a command's output and exit code (its pipes and its exit
    watched by readers on the loop), and a stop that signals its process group and waits for it."""
    env = {"PATH": os.environ["PATH"]}

    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        b = ProcessBackend()
        h = await b.start(RunSpec(task_id="t-1", token=1, command=("sh", "-c", "echo out; echo err >&2; exit 4")), env, tmp_path / "a")
        out = Output()
        res = await b.wait(h, out)
        assert (res.exit_code, res.failure_class) == (4, FAILURE_EXIT)
        assert out.data == {"stdout": b"out\n", "stderr": b"err\n"}
        await b.destroy(h)

        script = "trap 'echo got TERM; exit 0' TERM; echo ready; while true; do sleep 0.05; done"
        h = await b.start(RunSpec(task_id="t-2", token=2, command=("sh", "-c", script)), env, tmp_path / "b")
        out = Output()
        waiter = asyncio.create_task(b.wait(h, out))
        async with asyncio.timeout(30):
            while b"ready" not in out.data["stdout"]:
                await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await b.stop(h, kill_grace=10.0, failure_class=FAILURE_CANCELLED)
        res = await asyncio.wait_for(waiter, 30)
        assert b"got TERM" in out.data["stdout"] and time.monotonic() - t0 < 10
        assert res.failure_class == FAILURE_CANCELLED
        await b.destroy(h)

    run_loop(main())
