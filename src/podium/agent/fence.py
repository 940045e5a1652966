"""The fence keeper: a small process beside the agent that stops the node's attempts when the node's
lease runs out, even if the agent itself is frozen, stopped or dead.

Why a separate process: the promise "at most one attempt of a task runs at once" must hold when the
agent cannot act — a SIGSTOPped agent, a wedged event loop, an agent killed outright. The server gives
an attempt away only after OfflineAfter without a recorded heartbeat; the agent renews this process's
deadline each time a heartbeat is acknowledged, with a margin of two heartbeats before OfflineAfter. If
the deadline passes, or the agent's end of the pipe closes, every registered process group gets
SIGKILL. It is started in its own session, so signals meant for the agent do not reach it.

A group the agent forked but had not yet registered when it died (the fork and the `add` are a few
event-loop turns apart) is found when the pipe closes: every process task runs with
PODIUM_NODE_ID=<node> in its environment and leads its own session, and once its agent is dead it
has been handed to the same parent as this keeper (init, or a subreaper). A task of another agent
process of the same node (one that superseded this one) still has that agent as its parent, and is
left alone. (Tasks used to die with the agent by PR_SET_PDEATHSIG, set between fork and exec; that
costs a full fork of the agent per task: see agent/process_backend.py.)

Containers are fenced through the engine's own API: the keeper is given the engine's URL (`--engine
URL`, or `--engine env` for DOCKER_HOST and the default socket) and each container's id, and at the
fence it asks the engine to SIGKILL them. Why not the container's host PID from inspect (State.Pid)?
That number is in the engine's PID namespace, which need not be the agent's (an engine in its own
namespace, a remote engine over tcp): a PID from elsewhere could name an unrelated process here, and
killing it would be worse than useless. The engine's kill names exactly the container, wherever the
engine runs. The container stays (stopped) for the agent, or a restarted agent, to remove and prove
removed.

Protocol on stdin, one command a line (times are CLOCK_MONOTONIC, shared by every process):
    lease <deadline>              the attempts may run until <deadline>
    add <pgid> <task> <token>     a process group to fence
    del <pgid>                    that group ended by itself
    kill <why>                    kill every group now (the agent was superseded by another process)
    cadd <id> <task> <token>      a container (on the engine given at start) to fence
    cdel <id>                     that container ended by itself
    bye                           the agent is closing the pipe on purpose, alive (no sweep for orphans)
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
ENGINE_TIMEOUT = 5.0  # seconds one kill through the engine's API may take


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Engine:
    """The container engine, connected once when the first container is fenced (so the kill at the
    fence does not wait for an import and a handshake)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.api: object | None = None

    def connect(self) -> None:
        if self.api is not None or self.url is None:
            return
        try:
            import docker

            if self.url == "env":
                self.api = docker.from_env(timeout=ENGINE_TIMEOUT).api  # DOCKER_HOST, as the agent reads it
            else:
                self.api = docker.APIClient(base_url=self.url, timeout=ENGINE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - tried again at the fence
            print(f"fence: no container engine at {self.url}: {e}", file=sys.stderr)
            self.api = None

    def kill(self, container_id: str) -> None:
        self.connect()
        if self.api is None:
            return
        try:
            self.api.kill(container_id, "SIGKILL")  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - gone already, or not running: nothing to kill
            print(f"fence: kill {container_id[:12]}: {e}", file=sys.stderr)


def _orphans(node: str, agent: int) -> list[tuple[int, str]]:
    """Session leaders in this PID namespace, children of the dead `agent` or (handed on) of this
    keeper's new parent, whose environment names this node: task groups whose agent died before it
    could register them."""
    want = f"PODIUM_NODE_ID={node}".encode()
    # The pipe closes while the agent exits, before its children are handed on: wait for that, so
    # the new parent is known (the tasks are handed to the same one as this keeper).
    handed = time.monotonic() + 1.0
    while os.getppid() == agent and time.monotonic() < handed:
        time.sleep(0.005)
    if os.getppid() == agent:  # the agent lives on (it closed the pipe itself): its children are its own
        return []
    parents = {agent, os.getppid()}
    try:
        here = os.readlink("/proc/self/ns/pid")
    except OSError:
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                after = f.read().rsplit(")", 1)[1].split()
            # fields after the command: state ppid pgrp session
            if int(after[1]) not in parents or int(after[3]) != pid or os.readlink(f"/proc/{pid}/ns/pid") != here:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        task = next((e[len(b"PODIUM_TASK_ID="):] for e in env if e.startswith(b"PODIUM_TASK_ID=")), None)
        if want in env and task is not None:
            found.append((pid, task.decode(errors="replace")))
    return found


def main(journal: str | None, engine_url: str | None = None, node: str | None = None) -> None:
    deadline = float("inf")
    groups: dict[int, tuple[str, str]] = {}
    containers: dict[str, tuple[str, str]] = {}
    engine = _Engine(engine_url)
    agent = os.getppid()  # the agent started this keeper
    closing = False  # the agent said it closes the pipe on purpose
    buf = b""
    fd = sys.stdin.fileno()

    def record(task: str, token: str, why: str) -> None:
        if journal:
            with open(journal, "a") as f:
                f.write(json.dumps({"ev": "fence", "task": task, "token": int(token), "t": time.time(), "why": why}) + "\n")

    def fence(why: str) -> None:
        for pgid, (task, token) in list(groups.items()):
            _kill(pgid)
            record(task, token, why)
        groups.clear()
        for cid, (task, token) in list(containers.items()):
            engine.kill(cid)
            record(task, token, why)
        containers.clear()

    while True:
        ready, _, _ = select.select([fd], [], [], CHECK_EVERY)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the agent is gone: nothing may outlive it
                fence("agent gone")
                for pgid, task in _orphans(node, agent) if node and not closing else []:
                    _kill(pgid)
                    record(task, "0", "agent gone (never registered)")
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
                elif parts[0] == "cadd":
                    containers[parts[1]] = (parts[2], parts[3])
                    engine.connect()
                elif parts[0] == "cdel":
                    containers.pop(parts[1], None)
                elif parts[0] == "kill":
                    fence(" ".join(parts[1:]) or "told to")
                elif parts[0] == "bye":
                    closing = True
        if (groups or containers) and time.monotonic() > deadline:
            fence("lease expired")


class FenceKeeper:
    """The agent's handle on its fence process."""

    def __init__(self, journal: Path | None, engine: str | None = None, node: str | None = None) -> None:
        self.journal = journal
        self.node = node  # the node id its process tasks carry in PODIUM_NODE_ID
        self.engine = engine  # the container engine's URL, "env" for DOCKER_HOST; None: no containers
        self.proc: subprocess.Popen[bytes] | None = None
        self.deadline = 0.0
        self.groups: dict[int, tuple[str, int]] = {}
        # Deadlines that had passed when the next renewal came: the keeper may have fenced then. An
        # attempt's exit the agent notices only after such a renewal is still the fence's doing.
        self.lapses: deque[float] = deque(maxlen=32)
        self.containers: dict[str, tuple[str, int]] = {}

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            args = [sys.executable, "-m", "podium.agent.fence", "--journal", str(self.journal or "")]
            if self.engine:
                args += ["--engine", self.engine]
            if self.node:
                args += ["--node", self.node]
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, start_new_session=True)
            # a new keeper knows nothing: tell it everything
            self._write(f"lease {self.deadline}\n", ensure=False)
            for pgid, (task, token) in self.groups.items():
                self._write(f"add {pgid} {task} {token}\n", ensure=False)
            for cid, (task, token) in self.containers.items():
                self._write(f"cadd {cid} {task} {token}\n", ensure=False)
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
        """Kill every registered group and container at once, whatever the lease says."""
        if self.groups or self.containers:
            self._write(f"kill {why}\n")
            self.groups.clear()
            self.containers.clear()

    def add_container(self, container_id: str, task: str, token: int) -> None:
        self.containers[container_id] = (task, token)
        self._write(f"cadd {container_id} {task} {token}\n")

    def remove_container(self, container_id: str) -> None:
        if self.containers.pop(container_id, None) is not None:
            self._write(f"cdel {container_id}\n")

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.groups.clear()
            self.containers.clear()
            self._write("lease inf\nbye\n", ensure=False)
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    _args = sys.argv[1:]
    _opts = dict(zip(_args[::2], _args[1::2], strict=False))
    main(_opts.get("--journal") or None, _opts.get("--engine") or None, _opts.get("--node") or None)
