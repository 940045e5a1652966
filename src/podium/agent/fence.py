"""The fence keeper: a small process beside the agent that stops the node's attempts when the node's
lease runs out, even if the agent itself is frozen, stopped or dead.

Why a separate process: the promise "at most one attempt of a task runs at once" must hold when the
agent cannot act — a SIGSTOPped agent, a wedged event loop, an agent killed outright. The server gives
an attempt away only after OfflineAfter without a recorded heartbeat; the agent renews this process's
deadline each time a heartbeat is acknowledged, with a margin of two heartbeats before OfflineAfter. If
the deadline passes, or the agent's end of the pipe closes, every registered process group gets
SIGKILL. It is started in its own session, so signals meant for the agent do not reach it.

Protocol on stdin, one command a line (times are CLOCK_MONOTONIC, shared by every process):
    lease <deadline>              the attempts may run until <deadline>
    add <pgid> <task> <token>     a process group to fence
    del <pgid>                    that group ended by itself
    kill <why>                    kill every group now (the agent was superseded by another process)
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

CHECK_EVERY = 0.02  # seconds; how late past the deadline a fence can fire


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(journal: str | None) -> None:
    deadline = float("inf")
    groups: dict[int, tuple[str, str]] = {}
    buf = b""
    fd = sys.stdin.fileno()

    def fence(why: str) -> None:
        for pgid, (task, token) in list(groups.items()):
            _kill(pgid)
            if journal:
                with open(journal, "a") as f:
                    f.write(json.dumps({"ev": "fence", "task": task, "token": int(token), "t": time.time(), "why": why}) + "\n")
        groups.clear()

    while True:
        ready, _, _ = select.select([fd], [], [], CHECK_EVERY)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the agent is gone: nothing may outlive it
                fence("agent gone")
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                parts = line.decode().split()
                if not parts:
                    continue
                if parts[0] == "lease":
                    deadline = float(parts[1])
                elif parts[0] == "add":
                    groups[int(parts[1])] = (parts[2], parts[3])
                elif parts[0] == "del":
                    groups.pop(int(parts[1]), None)
                elif parts[0] == "kill":
                    fence(" ".join(parts[1:]) or "told to")
        if groups and time.monotonic() > deadline:
            fence("lease expired")


class FenceKeeper:
    """The agent's handle on its fence process."""

    def __init__(self, journal: Path | None) -> None:
        self.journal = journal
        self.proc: subprocess.Popen[bytes] | None = None
        self.deadline = 0.0
        self.groups: dict[int, tuple[str, int]] = {}
        # Deadlines that had passed when the next renewal came: the keeper may have fenced then. An
        # attempt's exit the agent notices only after such a renewal is still the fence's doing.
        self.lapses: deque[float] = deque(maxlen=32)

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            args = [sys.executable, "-m", "podium.agent.fence"] + ([str(self.journal)] if self.journal else [])
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, start_new_session=True)
            # a new keeper knows nothing: tell it everything
            self._write(f"lease {self.deadline}\n", ensure=False)
            for pgid, (task, token) in self.groups.items():
                self._write(f"add {pgid} {task} {token}\n", ensure=False)
        return self.proc

    def _write(self, line: str, ensure: bool = True) -> None:
        proc = self._ensure() if ensure else self.proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(line.encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.proc = None
            if ensure:
                self._ensure()

    def renew(self, deadline: float) -> None:
        if deadline > self.deadline:
            if self.groups and time.monotonic() > self.deadline:
                self.lapses.append(self.deadline)
            self.deadline = deadline
            self._write(f"lease {deadline}\n")

    def expired(self, at: float | None = None) -> bool:
        return (time.monotonic() if at is None else at) > self.deadline

    def lapsed(self, start: float, end: float) -> bool:
        """Whether the lease ran out at some moment between `start` and `end` (monotonic times),
        even if a renewal has come since."""
        return self.expired(end) or any(start <= t <= end for t in self.lapses)

    def add(self, pgid: int, task: str, token: int) -> None:
        self.groups[pgid] = (task, token)
        self._write(f"add {pgid} {task} {token}\n")

    def remove(self, pgid: int) -> None:
        if self.groups.pop(pgid, None) is not None:
            self._write(f"del {pgid}\n")

    def fence_now(self, why: str) -> None:
        """Kill every registered group at once, whatever the lease says."""
        if self.groups:
            self._write(f"kill {why}\n")
            self.groups.clear()

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.groups.clear()
            self._write("lease inf\n", ensure=False)
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
