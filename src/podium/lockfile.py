"""Exclusive ownership of a directory for the life of one process: an agent's state directory, the
data directory of `podium dev`.

An fcntl lock (flock) on a file in the directory, held on a descriptor kept open until the process
ends: the kernel lets go of it when the process dies, however it dies (SIGKILL included), so a stale
lock file never blocks the next start. The file also names the holder's pid, for the message a second
process gives. This module must never remove the lock file (a process that unlinks it could let two
holders in at once) nor hand the descriptor to a child process.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class Busy(Exception):
    """Another live process holds the lock."""

    def __init__(self, path: Path, pid: str) -> None:
        super().__init__(f"{path} is held by pid {pid or 'unknown'}")
        self.path = path
        self.pid = pid or "unknown"


def hold(path: Path) -> int:
    """Take the lock on `path` (created if missing) for the rest of this process's life; return its
    descriptor (keep it open). Raises Busy, naming the holder's pid, if another process has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC: a child (a task, the fence keeper, PostgreSQL) must not inherit the lock and keep it
    # after this process is gone
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.pread(fd, 64, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise Busy(path, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
