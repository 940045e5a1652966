"""The process backend: a task's command in its own process group, its own working directory, its
output streamed back in chunks.

A task's processes die with the agent (PR_SET_PDEATHSIG on the group leader): an attempt whose agent
is gone must not keep running behind the server's back while the server gives the task to another
node.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

CHUNK = 64 * 1024
_PR_SET_PDEATHSIG = 1

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover
    _libc = None


def _child_setup() -> None:  # runs in the child between fork and exec: keep it minimal
    os.setsid()
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


OutputSink = Callable[[str, bytes], Awaitable[None]]


class ProcessRun:
    def __init__(self, command: list[str], env: dict[str, str], workdir: Path) -> None:
        self.command = command
        self.env = env
        self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            *self.command,
            cwd=str(self.workdir),
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_child_setup,
        )

    async def wait(self, sink: OutputSink) -> int:
        """Stream output to `sink` until the process and its pipes are done; return a shell-style exit
        code (128 + signal for a process killed by a signal)."""
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None

        async def pump(stream: asyncio.StreamReader, name: str) -> None:
            while True:
                data = await stream.read(CHUNK)
                if not data:
                    return
                await sink(name, data)

        await asyncio.gather(pump(self.proc.stdout, "stdout"), pump(self.proc.stderr, "stderr"))
        rc = await self.proc.wait()
        return 128 - rc if rc < 0 else rc

    async def stop(self, kill_grace: float) -> None:
        """SIGTERM to the whole group, SIGKILL after `kill_grace` if anything is still there."""
        if self.proc is None or self._stopping:
            return
        self._stopping = True
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout=kill_grace)
        # the leader may be gone while children in its group live on: kill the group regardless
        _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
