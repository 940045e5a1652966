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

Why not asyncio's subprocess transports: for a short command they cost the agent more than the
command itself — a transport and a protocol for each pipe, StreamReaders, a task connecting them, a
child watcher — 0.74-0.94 ms of the agent's CPU a start here against 0.44-0.49 ms for the same
`subprocess.Popen` (the same vfork, cwd and closed descriptors) with its two pipes read straight off
the loop and its exit learnt from a pidfd (bench/process_start.py; docs/benchmarks.md, eleventh
session).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from podium.agent import fence

CHUNK = 64 * 1024
# how long a started command runs before its pipes are watched on the loop; until then (and for a
# command that ends sooner, which is most of them) they are read once it has exited (`_watch_exit`)
QUIET_START = 0.005  # seconds
# bytes read but not yet taken by the sink past which the pipes are not read (the process then
# blocks on its writes): a slow sink never makes the agent hold a task's whole output
HIGH_WATER = 2 * CHUNK

OutputSink = Callable[[str, bytes], Awaitable[None]]

# How long where a command's name was found on PATH is kept (see `executable`).
LOOKUP_TTL = 1.0
LOOKUPS_KEPT = 1024
_found: dict[tuple[str, str], tuple[str, float]] = {}

_devnull: int | None = None


def devnull() -> int:
    """A descriptor of /dev/null for reading, opened once and kept (close-on-exec: the child is given
    it as its stdin only). `stdin=subprocess.DEVNULL` opened and closed one for every start: two
    system calls a task, a twentieth of a busy agent's loop in a profile (issue 17)."""
    global _devnull
    if _devnull is None:
        _devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull


def executable(name: str, path: str) -> str | None:
    """The file a command named `name` runs as on `path`, the first directory's executable file of
    that name, as the child's own search finds it; None to leave the search to the child (a name
    with a directory in it, a relative or empty entry before the hit, which means the child's working
    directory, or no hit at all, which the child reports as it always has).

    Why: the child's search tries `execve` in each directory until one succeeds (8 failures for
    `true` on the bench's PATH), while the parent, suspended by the vfork, waits, and first builds
    the list of candidates in Python (os.get_exec_path, which resets the warnings filters on every
    call). Found once, a name is kept for LOOKUP_TTL: a command installed in an earlier directory
    of PATH is run from there a second later at most (a shell's remembered paths are never looked
    up again unless the file goes away)."""
    if os.sep in name:
        return None
    now = time.monotonic()
    hit = _found.get((path, name))
    if hit is not None and hit[1] > now:
        return hit[0]
    for d in path.split(os.pathsep):
        if not os.path.isabs(d):
            return None
        f = os.path.join(d, name)
        if os.path.isfile(f) and os.access(f, os.X_OK):
            if len(_found) >= LOOKUPS_KEPT:
                _found.clear()
            _found[(path, name)] = (f, now + LOOKUP_TTL)
            return f
    return None


class ProcessRun:
    def __init__(self, command: list[str], env: dict[str, str], workdir: Path) -> None:
        self.command = command
        self.env = env
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self._pipes: _Pipes | None = None
        self._exit: asyncio.Future[int] | None = None
        self._stopping = False
        # what names the process for good (`fence.same_group`): a pidfs inode; None: its start time
        self.identity: str | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self) -> None:
        out_r, out_w = os.pipe()  # close-on-exec here; the child gets them as 1 and 2 only
        try:
            err_r, err_w = os.pipe()
        except OSError:  # out of descriptors: give back the first pair
            os.close(out_r)
            os.close(out_w)
            raise
        try:
            try:
                self.proc = self._popen(out_w, err_w)
            except FileNotFoundError as e:
                # The agent has made the directory already (agent/workdirs.py, before Accepted): looking
                # for it at every start cost a failed mkdir and a stat. A caller that did not make it
                # learns so from the child's chdir, and it is made here.
                if e.filename != str(self.workdir):
                    raise
                self.workdir.mkdir(parents=True, exist_ok=True)
                self.proc = self._popen(out_w, err_w)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            # only the child writes: its pipes end when it and whatever it started close them
            os.close(out_w)
            os.close(err_w)
        loop = asyncio.get_running_loop()
        self._pipes = _Pipes(loop, {out_r: "stdout", err_r: "stderr"})
        self._exit = loop.create_future()
        self._watch_exit(loop)

    def _watch_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Learn of the exit as it happens, and read the pipes only once it has, or once it has run for
        QUIET_START: a short command's output is all in its pipes when it exits, read then in one go.
        Watching each pipe on the loop from the start cost two registrations and two removals a task
        (Linux's epoll_ctl, and asyncio's bookkeeping around each), more than the rest of the reading.

        The pidfd is readable once the process has exited; it also names the process for good (on a
        kernel with pidfs its inode is never another process's): the fence keeper is given that,
        instead of a start time read from /proc, which costs more while the child is still being
        exec'd. Without a pidfd (an old kernel, not Linux) a thread waits, and the pipes are watched
        from the start."""
        assert self.proc is not None and self._pipes is not None and self._exit is not None
        proc, pipes, done = self.proc, self._pipes, self._exit
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pipes.watch()

            # a thread of its own, not the loop's executor: a long task would hold one of its few
            # workers for its whole run (and the working directories' removals queue behind them)
            def wait() -> None:
                rc = proc.wait()
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_set, done, rc)

            threading.Thread(target=wait, name=f"wait-{proc.pid}", daemon=True).start()
            return
        self.identity = fence.pidfd_identity(pidfd)
        later = loop.call_later(QUIET_START, pipes.watch)

        def exited() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            later.cancel()
            _set(done, proc.wait())  # it has exited: the wait only reaps it
            pipes.read_now()  # everything it wrote is there; a pipe still open elsewhere is watched

        loop.add_reader(pidfd, exited)

    def _popen(self, out_w: int, err_w: int) -> subprocess.Popen[bytes]:
        path = self.env.get("PATH", os.defpath)
        exe = executable(self.command[0], path)
        try:
            return self._spawn(exe, out_w, err_w)
        except OSError as e:
            if exe is None or e.filename != exe:
                raise
            # gone (or not runnable) since it was found: the child's own search, as without the lookup
            _found.pop((path, self.command[0]), None)
            return self._spawn(None, out_w, err_w)

    def _spawn(self, exe: str | None, out_w: int, err_w: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.command,
            executable=exe,  # argv[0] stays the name the spec gave
            cwd=str(self.workdir),
            env=self.env,
            stdin=devnull(),
            stdout=out_w,
            stderr=err_w,
            start_new_session=True,  # its own session and group (setsid), with no Python in the child
        )

    async def wait(self, sink: OutputSink) -> int:
        """Stream output to `sink` until the process and its pipes are done; return a shell-style exit
        code (128 + signal for a process killed by a signal)."""
        assert self._pipes is not None
        try:
            await self._pipes.drain(sink)
        finally:
            self._pipes.close()
        rc = await asyncio.shield(self._exited())  # a cancelled waiter leaves it for the next (stop)
        return 128 - rc if rc < 0 else rc

    def _exited(self) -> asyncio.Future[int]:
        """The process's return code once it has exited (and been reaped), for every waiter."""
        assert self._exit is not None
        return self._exit

    async def stop(self, kill_grace: float) -> None:
        """SIGTERM to the whole group, SIGKILL after `kill_grace` if anything is still there."""
        if self.proc is None or self._stopping:
            return
        self._stopping = True
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            # not wait_for, which in Python 3.11 loses a cancel that comes as the wait ends
            async with asyncio.timeout(kill_grace):
                await asyncio.shield(self._exited())
        # the leader may be gone while children in its group live on: kill the group regardless
        _signal_group(pgid, signal.SIGKILL)


class _Pipes:
    """A process's output pipes, read in the order the bytes arrive: on the loop as they become
    readable once `watch`ed, or all at once (`read_now`) when the process has exited; reading stops
    while HIGH_WATER bytes wait for the sink, and resumes once it has them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, names: dict[int, str]) -> None:
        self.loop = loop
        self.names = names  # the pipes still open: fd → stream name
        self.chunks: deque[tuple[str, bytes]] = deque()
        self.buffered = 0
        self.paused = False
        self.watching = False  # registered with the loop (watch); before that, read only by read_now
        self.wake: asyncio.Future[None] | None = None
        for fd in names:
            os.set_blocking(fd, False)

    def watch(self) -> None:
        """Read each pipe on the loop as it becomes readable, from now on."""
        if self.watching:
            return
        self.watching = True
        if not self.paused:
            for fd in self.names:
                self.loop.add_reader(fd, self._readable, fd)

    def read_now(self) -> None:
        """Read what the pipes hold now (the process has exited: all it wrote), up to HIGH_WATER; a
        pipe not at its end (a process it started holds it open, or the sink is behind) is watched."""
        for fd in list(self.names):
            while fd in self.names and not self.paused and self._read(fd):
                pass
        if self.names:
            self.watch()
        self._woken()

    def _readable(self, fd: int) -> None:
        self._read(fd)
        self._woken()

    def _read(self, fd: int) -> bool:
        """One read of `fd`: whether it gave bytes (False: nothing now, or its end)."""
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""  # nothing more can be read from it
        if not data:
            self._close(fd)
            return False
        self.chunks.append((self.names[fd], data))
        self.buffered += len(data)
        if self.buffered >= HIGH_WATER:
            self._pause()
        return True

    def _woken(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _pause(self) -> None:
        self.paused = True
        if self.watching:
            for fd in self.names:
                self.loop.remove_reader(fd)

    def _resume(self) -> None:
        self.paused = False
        if self.watching:
            for fd in self.names:
                self.loop.add_reader(fd, self._readable, fd)

    def _close(self, fd: int) -> None:
        del self.names[fd]
        if self.watching:
            self.loop.remove_reader(fd)
        os.close(fd)

    async def drain(self, sink: OutputSink) -> None:
        """Hand every chunk to `sink` until both pipes are closed."""
        while self.names or self.chunks:
            if not self.chunks:
                self.wake = self.loop.create_future()
                await self.wake
                continue
            stream, data = self.chunks.popleft()
            self.buffered -= len(data)
            await sink(stream, data)
            if self.paused and self.buffered < HIGH_WATER:
                self._resume()

    def close(self) -> None:
        for fd in list(self.names):
            self._close(fd)


def _set(done: asyncio.Future[int], rc: int) -> None:
    if not done.done():
        done.set_result(rc)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
