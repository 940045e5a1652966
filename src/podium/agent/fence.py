"""The fence keeper: a small process beside the agent that stops the node's attempts when the node's
lease runs out, even if the agent itself is frozen, stopped or dead.

Why a separate process: the promise "at most one attempt of a task runs at once" must hold when the
agent cannot act — a SIGSTOPped agent, a wedged event loop, an agent killed outright. The server gives
an attempt away only after OfflineAfter without a recorded heartbeat; the agent renews this process's
deadline each time a heartbeat is acknowledged, with a margin of two heartbeats before OfflineAfter. If
the deadline passes, or the agent's end of the pipe closes, every registered process group gets
SIGKILL. It is started in its own session, so signals meant for the agent do not reach it.

The agent writes a started group's `add` at the end of its loop's turn, with every other group
started in that turn (one write and one wake of the keeper for a batch of starts). A group forked but
not yet registered is found by a sweep of the agent's children: at each lapse of the lease (the
agent's loop stalled between the fork and the write), and when the pipe closes (the agent died
there). Every process task runs with PODIUM_NODE_ID=<node> in its environment and leads its own
session; once its agent is dead it has been handed to the same parent as this keeper (init, or a
subreaper). A task of another agent process of the same node (one that superseded this one) has that
agent as its parent, and is left alone. (Tasks used to die with the agent by PR_SET_PDEATHSIG, set
between fork and exec; that costs a full fork of the agent per task: see agent/process_backend.py.)

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
    add <pgid> <task> <token> <start>
                                  a process group to fence; <start> names its leader for good:
                                  i<inode> (its pidfd's, on a kernel with pidfs), or its start time
                                  (/proc/<pid>/stat, clock ticks since boot; 0 when unknown)
    del <pgid>                    that group ended by itself
    kill <why>                    kill every group now (the agent was superseded by another process)
    cadd <id> <task> <token>      a container (on the engine given at start) to fence
    cdel <id>                     that container ended by itself
    bye                           the agent is closing the pipe on purpose, alive (no sweep for orphans)

What it killed, and why, the keeper writes to the kills file (`--kills FD`, a file the agent made and
reads), one line per attempt *before* it sends the kill:
    <token> <why>
    p<pgid> <why>                 a group killed at a lapse before its `add` came (see below)
So when the agent sees an attempt die of SIGKILL, the keeper's line for it is already there to read:
the agent knows who killed it rather than guessing from its clock whether the lease had run out
(a guess that was wrong when the lease had already run out before the attempt started, or when a
late acknowledgement renewed it before the agent saw the exit).

A process group id is a pid, and pids are reused (32768 of them on many machines). A group whose
leader has been reaped while the agent's `del` is on its way could be another process's by the
time the lease runs out; the keeper kills a group only while its leader is still the process that
was registered (the same pidfs inode or start time: `identity`), or gone with its number not yet
reused (a number stays taken while any member of its group lives).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECK_EVERY = 0.02  # seconds; how late past the deadline a fence can fire
ENGINE_TIMEOUT = 5.0  # seconds one kill through the engine's API may take
LEASE_EXPIRED = "lease expired"  # the keeper's word for a kill at the deadline
# seconds a `del` may wait for the next line to ride with (see FenceKeeper.remove)
HOLD_DELS = 0.05


def start_time(pid: int) -> int | None:
    """When the process `pid` started (clock ticks since boot), None if there is no such process: with
    the pid, it names one process for good, even once the pid is reused."""
    try:
        # read once per task start: the descriptor alone, not a file object (7-14 µs less here)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 4096)  # a few hundred bytes, all of it in one read
        finally:
            os.close(fd)
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from the last ")"
    fields = stat.rpartition(b")")[2].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


@functools.cache
def pidfs() -> bool:
    """Whether a pidfd's inode names its process for good: on Linux 6.9 and later (pidfs) every process
    has an inode number of its own, never given to another while the machine runs; before, every
    pidfd shared one anonymous inode."""
    try:
        mine = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    try:
        other = os.pidfd_open(os.getppid() or 1)
    except OSError:
        os.close(mine)
        return False
    try:
        return os.fstat(mine).st_ino != os.fstat(other).st_ino
    finally:
        os.close(mine)
        os.close(other)


def pidfs_inode(pid: int) -> int | None:
    """The pidfs inode of the process `pid` (see `pidfs`), None if there is no such process."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _pidfs_name(inode: int) -> str:
    return f"i{inode}"


def pidfd_identity(pidfd: int) -> str | None:
    """`identity` of the process a pidfd names, from the pidfd itself; None without pidfs."""
    return _pidfs_name(os.fstat(pidfd).st_ino) if pidfs() else None


def identity(pid: int) -> str:
    """What names the process `pid` for good, as the keeper's `add` carries it: `i<inode>` (pidfs), or
    its start time (clock ticks since boot; 0 if it is not there)."""
    if pidfs():
        ino = pidfs_inode(pid)
        if ino is not None:
            return _pidfs_name(ino)
    return str(start_time(pid) or 0)


def same_group(pgid: int, started: str) -> bool:
    """Whether `pgid` may still be the group registered with its leader's identity `started` (see
    `identity`; "0": not known): False when the number now names another process (the group registered
    is gone). A leader already reaped is fine: the number stays taken while any member of its group
    lives."""
    if started.startswith("i"):
        ino = pidfs_inode(pgid)
        return ino is None or ino == int(started[1:])
    now = start_time(pgid)
    return not (int(started) and now is not None and now != int(started))


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    # The pipe closes while the agent exits, before its children are handed on: wait for that, so
    # the new parent is known (the tasks are handed to the same one as this keeper).
    handed = time.monotonic() + 1.0
    while os.getppid() == agent and time.monotonic() < handed:
        time.sleep(0.005)
    if os.getppid() == agent:  # the agent lives on (it closed the pipe itself): its children are its own
        return []
    return _task_leaders(node, {agent, os.getppid()})


def _task_leaders(node: str, parents: set[int]) -> list[tuple[int, str]]:
    """Session leaders in this PID namespace whose parent is one of `parents` and whose environment
    names this node: the task groups of this node's agent (this keeper itself excepted)."""
    want = f"PODIUM_NODE_ID={node}".encode()
    me = os.getpid()
    try:
        here = os.readlink("/proc/self/ns/pid")
    except OSError:
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
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


def main(journal: str | None, engine_url: str | None = None, kills_fd: int | None = None, node: str | None = None) -> None:
    deadline = float("inf")
    groups: dict[int, tuple[str, str, str]] = {}
    containers: dict[str, tuple[str, str]] = {}
    engine = _Engine(engine_url)
    agent = os.getppid()  # the agent started this keeper
    closing = False  # the agent said it closes the pipe on purpose
    buf = b""
    fd = sys.stdin.fileno()

    def tell(token: str, why: str) -> None:
        # before the kill: whoever sees the attempt die can already read who killed it
        if kills_fd is not None:
            try:
                os.write(kills_fd, f"{int(token)} {why}\n".encode())
            except OSError as e:  # the kill matters more than the word about it
                print(f"fence: cannot write the kills file: {e}", file=sys.stderr)

    def record(task: str, token: str, why: str) -> None:
        if journal:
            with open(journal, "a") as f:
                f.write(json.dumps({"ev": "fence", "task": task, "token": int(token), "t": time.time(), "why": why}) + "\n")

    def tell_group(pgid: int, why: str) -> None:
        # a group killed before the agent's `add` for it came: named by its number, which the agent
        # knows the attempt of (FenceKeeper.killed)
        if kills_fd is not None:
            with contextlib.suppress(OSError):
                os.write(kills_fd, f"p{pgid} {why}\n".encode())

    def unregistered(why: str) -> None:
        """At a lapse: the live agent's task groups it has not told of yet (an `add` waits for the end
        of the agent's loop turn, and a loop stalled right there must not leave its group running)."""
        if not node:
            return
        for pgid, task in _task_leaders(node, {agent}):
            if pgid not in groups:
                tell_group(pgid, why)
                kill_group(pgid)
                record(task, "0", f"{why} (not registered yet)")

    swept_for: float | None = None  # the deadline whose lapse was swept for unregistered groups

    def fence(why: str) -> None:
        for pgid, (task, token, started) in list(groups.items()):
            if not same_group(pgid, started):
                continue  # ended by itself, and its number is already another process's
            tell(token, why)
            kill_group(pgid)
            record(task, token, why)
        groups.clear()
        for cid, (task, token) in list(containers.items()):
            tell(token, why)
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
                    kill_group(pgid)
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
                    groups[int(parts[1])] = (parts[2], parts[3], parts[4] if len(parts) > 4 else "0")
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
        if time.monotonic() > deadline:
            if swept_for != deadline:  # once a lapse: the agent tells what it starts after it at once
                swept_for = deadline
                unregistered(LEASE_EXPIRED)
            if groups or containers:
                fence(LEASE_EXPIRED)


class FenceKeeper:
    """The agent's handle on its fence process."""

    def __init__(self, journal: Path | None, engine: str | None = None, node: str | None = None) -> None:
        self.journal = journal
        self.node = node  # the node id its process tasks carry in PODIUM_NODE_ID
        self.engine = engine  # the container engine's URL, "env" for DOCKER_HOST; None: no containers
        self.proc: subprocess.Popen[bytes] | None = None
        self.deadline = 0.0
        # the last moment a renewal ended a lapse (monotonic): the deadline had passed before it came
        self.lapse_ended = float("-inf")
        self.groups: dict[int, tuple[str, int, str]] = {}  # pgid → (task, token, leader's identity)
        self.containers: dict[str, tuple[str, int]] = {}
        # What the keeper killed: a file it appends to and this process reads (in memory, never on a
        # disk; shared by every keeper this handle starts, so a restarted keeper's word is kept too).
        self._kills_fd = _kills_file()
        self._kills_read = 0
        self._killed: dict[int, str] = {}  # token → why, for attempts still fenced
        self._held: list[str] = []  # `add` and `del` lines not written yet (see add, remove)
        self._flush_at: asyncio.Handle | None = None
        self._flush_soon = False  # the flush waiting is the loop's next turn, not HOLD_DELS

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self._drop()
            args = [sys.executable, "-m", "podium.agent.fence", "--journal", str(self.journal or ""),
                    "--kills", str(self._kills_fd)]  # fmt: skip
            if self.engine:
                args += ["--engine", self.engine]
            if self.node:
                args += ["--node", self.node]
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, start_new_session=True, pass_fds=(self._kills_fd,))
            # a new keeper knows nothing: tell it everything
            self._write(f"lease {self.deadline}\n", ensure=False)
            for pgid, (task, token, started) in self.groups.items():
                self._write(f"add {pgid} {task} {token} {started}\n", ensure=False)
            for cid, (task, token) in self.containers.items():
                self._write(f"cadd {cid} {task} {token}\n", ensure=False)
        return self.proc

    def _write(self, line: str, ensure: bool = True) -> None:
        proc = self._ensure() if ensure else self.proc
        assert proc is not None and proc.stdin is not None
        if self._held:  # ahead of the line, in the order they were held
            line = "".join(self._held) + line
            self._held.clear()
        try:
            proc.stdin.write(line.encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._drop()
            if ensure:
                self._ensure()

    def _drop(self) -> None:
        """Forget a keeper that has died (its pipe with it)."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.proc = None

    def renew(self, deadline: float) -> None:
        if deadline > self.deadline:
            now = time.monotonic()
            if now > self.deadline:
                self.lapse_ended = now
            self.deadline = deadline
            self._write(f"lease {deadline}\n")

    def expired(self, at: float | None = None) -> bool:
        return (time.monotonic() if at is None else at) > self.deadline

    def lapsed_since(self, since: float) -> bool:
        """Whether the lease has run out at some moment after `since` (monotonic), renewed since or
        not. The server may give a node's attempts away once it has not heard from it for
        OfflineAfter, which is after the lease runs out: an attempt assigned before a lapse may be
        another node's by now, and must not be started here."""
        return self.expired() or self.lapse_ended > since

    def killed(self, token: int) -> str | None:
        """Why the keeper killed the attempt with this fencing token, or None if it did not. Read
        once the attempt's process is known to be dead: the keeper writes its word before it kills,
        so a death it caused is always found here."""
        while self._kills_fd >= 0:  # closed: the agent is shutting down, nothing more to learn
            chunk = os.pread(self._kills_fd, 65536, self._kills_read)
            if not chunk:
                break
            complete = chunk[: chunk.rfind(b"\n") + 1]
            if not complete:
                break  # half a line: the keeper is writing it; the rest comes on the next read
            self._kills_read += len(complete)
            fenced = {t for _, t, _ in self.groups.values()} | {t for _, t in self.containers.values()} | {token}
            for line in complete.decode(errors="replace").splitlines():
                tok, _, why = line.partition(" ")
                if tok.startswith("p") and tok[1:].isdigit():  # a group killed before its `add` came
                    group = self.groups.get(int(tok[1:]))
                    tok = str(group[1]) if group is not None else ""
                # kept only for an attempt still fenced: a late word about an attempt already
                # decided is of no use to anyone, and would only pile up
                if tok.isdigit() and int(tok) in fenced:
                    self._killed[int(tok)] = why or "killed"
        return self._killed.pop(token, None)

    def add(self, pgid: int, task: str, token: int, started: str | None = None) -> None:
        """A started group to fence. The keeper is told at the end of this turn of the agent's loop,
        with every other group started in it (an agent starts a batch of accepted attempts in one
        turn): one pipe write and one wake of the keeper for them all, not one each. Safe to tell a
        turn late: if the agent dies first, the keeper's sweep for orphans finds the group; if its loop
        stalls past the lease first, the keeper's sweep at the lapse does (both look for this node's
        task groups among the agent's children, `_task_leaders`). Told at once when neither sweep can
        find it: a keeper that does not know the node, or a lease already run out (no sweep comes)."""
        # `started`: the leader's identity if the caller has it already (ProcessRun, from its pidfd)
        self.groups[pgid] = (task, token, started or identity(pgid))
        line = f"add {pgid} {task} {token} {self.groups[pgid][2]}\n"
        if self.node and not self.expired():
            self._hold(line, soon=True)
        else:
            self._write(line)

    def remove(self, pgid: int) -> None:
        """The group ended by itself. The keeper is told with the next line written (the next start's
        `add`, in a burst) or within HOLD_DELS: one pipe write, one wake of the keeper, instead of
        two per task. Safe to tell late: until it hears, the keeper would kill the group at a lapse
        only while its leader is still the process registered (`same_group`), and the attempt is
        over for the agent already (its word from the keeper was read before this)."""
        if self.groups.pop(pgid, None) is None:
            return
        self._hold(f"del {pgid}\n", soon=False)

    def _hold(self, line: str, soon: bool) -> None:
        """Write `line` with the next line written, or at the loop's next turn (`soon`), or within
        HOLD_DELS, whichever comes first; now when no loop runs (a caller outside the agent)."""
        self._held.append(line)
        if self._flush_at is not None and (self._flush_soon or not soon):
            return  # a flush as soon as this one needs is already on its way
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush_held()
            return
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._flush_soon = soon
        self._flush_at = loop.call_soon(self._flush_held) if soon else loop.call_later(HOLD_DELS, self._flush_held)

    def _flush_held(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()  # flushed early, by a line written meanwhile: nothing for it to do
        self._flush_at = None
        if not self._held:
            return
        if self.proc is None:  # no keeper now: the next one is told only the groups still fenced
            self._held.clear()
            return
        self._write("")

    def fence_now(self, why: str) -> None:
        """Kill every registered group and container at once, whatever the lease says: the groups
        from here (no wait for the keeper to read its pipe), and everything through the keeper."""
        for pgid, (_task, _token, started) in self.groups.items():
            if same_group(pgid, started):
                kill_group(pgid)
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
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self.proc is not None and self.proc.stdin is not None:
            self.groups.clear()
            self.containers.clear()
            self._write("lease inf\nbye\n", ensure=False)
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
        if self._kills_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._kills_fd)
            self._kills_fd = -1  # closed once: the number may be another file's afterwards


def _kills_file() -> int:
    """A file descriptor for the keeper's word on its kills: an anonymous file in memory (Linux), else
    an unlinked temporary file. Not inherited by anything but the keepers it is passed to."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("podium-fence-kills")  # close-on-exec: only pass_fds hands it on
    fd, path = tempfile.mkstemp(prefix="podium-fence-kills-")
    os.unlink(path)
    return fd


if __name__ == "__main__":
    _args = sys.argv[1:]
    _opts = dict(zip(_args[::2], _args[1::2], strict=False))
    main(_opts.get("--journal") or None, _opts.get("--engine") or None,
         int(_opts["--kills"]) if _opts.get("--kills") else None, _opts.get("--node") or None)
