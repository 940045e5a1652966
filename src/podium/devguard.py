"""The guard of `podium dev`: a small process that outlives `podium dev` only long enough to clean up
after it, however it ends (SIGKILL included).

`podium dev` starts processes that would otherwise outlive it: its local agent (and, through the
agent's fence keeper, the agent's tasks) and the embedded PostgreSQL, which daemonizes. An orphaned
agent is a second process presenting the node's identity when the next `podium dev` starts its own.
The guard holds the read end of a pipe from `podium dev`; when it reads end-of-file, `podium dev` is
gone, and the guard kills the agents it was told about and stops the embedded PostgreSQL if no live
process still holds a handle on it. It also holds the data directory's lock (inherited), so the next
`podium dev` on that directory starts only once the cleanup is done.

This module must never stop a PostgreSQL that another live process uses, nor kill a process it was
not told about (a pid is checked against its start time before it is signalled).

Protocol on stdin, one line each:  agent <pid> <create_time>
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import psutil

STOP_WAIT = 30.0  # seconds PostgreSQL gets for a fast shutdown before an immediate one


def _same(pid: int, create_time: float) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - create_time) < 0.01 else None
    except psutil.Error:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a killed, unreaped `podium dev` is gone
    except psutil.Error:
        return False


def _stop_postgres(pg_dir: Path) -> None:
    pidfile = pg_dir / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().split("\n", 1)[0])
        proc = psutil.Process(pid)
        if "postgres" not in proc.name():
            return
    except (OSError, ValueError, psutil.Error):
        return  # not running (or not ours to judge)
    handles = pg_dir / ".handle_pids.json"
    try:
        holders = [int(p) for p in json.loads(handles.read_text() or "[]")]
    except (OSError, ValueError, TypeError):
        holders = []
    alive = [p for p in holders if _alive(p)]
    if alive:
        return  # another live process uses this PostgreSQL: it stops it when it is done
    # the handles of dead processes would keep the next clean stop from stopping it
    with contextlib.suppress(OSError):
        handles.write_text(json.dumps([]))
    for sig, wait in ((signal.SIGINT, STOP_WAIT), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
        try:
            proc.send_signal(sig)  # SIGINT: PostgreSQL's fast shutdown
            proc.wait(wait)
            return
        except psutil.TimeoutExpired:
            continue
        except psutil.Error:
            return


def main(data_dir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is `podium dev`'s to handle, not ours
    agents: list[tuple[int, float]] = []
    buf = b""
    while True:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "agent":
                agents.append((int(parts[1]), float(parts[2])))
    for pid, created in agents:
        proc = _same(pid, created)
        if proc is not None:
            try:
                proc.kill()  # its fence keeper sees it go and kills its tasks
                proc.wait(10)
            except psutil.Error:
                pass
    _stop_postgres(Path(data_dir) / "pg")
    # the inherited lock on the data directory is released as this process exits


if __name__ == "__main__":
    main(sys.argv[1])
