"""The process backend: a task's command in its own process group, its own working directory, its
output streamed back in chunks.

A task's processes die with the agent: an attempt whose agent is gone must not keep running behind
the server's back while the server gives the task to another node. The fence keeper does it (it kills
every group it was told of when the agent's end of its pipe closes, and sweeps for a group forked
just before the agent died, before it could be told: agent/fence.py).

Why not PR_SET_PDEATHSIG in the child, as before: that needs Python code between fork and exec
(`preexec_fn`), which forces a full fork of the agent (its threads, its page tables) and runs the
interpreter in the child — 3.4 ms of the agent's CPU per task here, against 0.4 ms for the vfork that
`start_new_session` allows (issue 17).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path

CHUNK = 64 * 1024

_PIDFD_WORKS: bool | None = None


def watch_exits_by_pidfd() -> None:
    """Learn of a task's exit from a pidfd on the agent's own loop. Python 3.11's default watcher
    starts a thread per child to wait for it (0.3-0.5 ms of CPU per task here); 3.12 and later use
    pidfds by themselves. The watcher is the process's, bound to one loop: only for a process that
    runs one loop for its life (`podium agent` calls it once its loop runs). Installed anywhere else,
    a later loop of that process (a library's, a test's) could start no subprocess at all."""
    global _PIDFD_WORKS
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    if _PIDFD_WORKS is None:  # a kernel before 5.3, or a sandbox that refuses the call: the threads then
        try:
            os.close(os.pidfd_open(os.getpid()))
            _PIDFD_WORKS = True
        except OSError:
            _PIDFD_WORKS = False
    if not _PIDFD_WORKS:
        return
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = policy.get_child_watcher()
        if not isinstance(watcher, asyncio.PidfdChildWatcher):
            watcher = asyncio.PidfdChildWatcher()
            policy.set_child_watcher(watcher)
        # attach_loop forgets every child being watched: only for a loop not yet watched (a new one)
        if not watcher.is_active():
            watcher.attach_loop(asyncio.get_running_loop())


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
        # the agent has made it already (agent/workdirs.py, before Accepted): for it this only finds it
        # there, which allocates nothing; a caller that starts a run on its own gets it made here
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            *self.command,
            cwd=str(self.workdir),
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own session and group (setsid), with no Python in the child
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
