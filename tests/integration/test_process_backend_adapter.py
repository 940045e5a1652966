"""The process backend behind the driver interface (backends/process.py over ProcessRun): the same
verbs and results the container backend gives, on real process groups."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

import podium.agent.backends as backends
from podium.agent.backends import FAILURE_CANCELLED, FAILURE_EXIT, FAILURE_TIMEOUT, RunSpec, StartFailed
from podium.agent.backends.process import ProcessBackend

pytestmark = pytest.mark.timeout(60)


class Output:
    def __init__(self) -> None:
        self.data = {"stdout": b"", "stderr": b""}

    async def __call__(self, stream: str, data: bytes) -> None:
        self.data[stream] += data


def spec(*command: str) -> RunSpec:
    return RunSpec(task_id="t-1", token=1, command=command)


def test_the_failure_classes_are_the_seeds() -> None:
    assert {
        "exit", "timeout", "cancelled", "node_lost", "not_accepted", "provisioning", "oom", "internal"
    } == backends.FAILURE_CLASSES  # fmt: skip
    modules = ("base", "process", "container")
    assert sorted(backends.__all__) == sorted(n for n in dir(backends) if not n.startswith("_") and n not in modules)


async def test_output_exit_code_and_proof(tmp_path: Path) -> None:
    b = ProcessBackend()
    fp = await b.fingerprint()
    assert fp.available and fp.kind == "process" and not fp.enforces_limits
    h = await b.start(spec("sh", "-c", "echo out; echo err >&2; exit 4"), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    out = Output()
    res = await b.wait(h, out)
    assert (res.exit_code, res.failure_class) == (4, FAILURE_EXIT) and out.data == {"stdout": b"out\n", "stderr": b"err\n"}
    proof = await b.destroy(h)
    assert proof.ref == h.ref and proof.at <= datetime.now(UTC)
    assert await b.recover() == []


@pytest.mark.parametrize("why", [FAILURE_CANCELLED, FAILURE_TIMEOUT])
async def test_stop_is_sigterm_then_sigkill_after_the_grace(tmp_path: Path, why: str) -> None:
    b = ProcessBackend()
    script = "trap 'echo got TERM' TERM; echo ready; while true; do sleep 0.1; done"
    h = await b.start(spec("sh", "-c", script), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    out = Output()
    waiter = asyncio.create_task(b.wait(h, out))
    async with asyncio.timeout(30):
        while b"ready" not in out.data["stdout"]:
            await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await b.stop(h, kill_grace=1.0, failure_class=why)
    res = await waiter
    assert time.monotonic() - t0 >= 0.9 and b"got TERM" in out.data["stdout"]
    assert (res.exit_code, res.failure_class) == (137, why)
    await b.destroy(h)
    with pytest.raises(ProcessLookupError):
        os.killpg(int(h.ref), 0)


async def test_a_missing_command_is_the_exit_a_shell_gives(tmp_path: Path) -> None:
    with pytest.raises(StartFailed) as ei:
        await ProcessBackend().start(spec("/no/such/command"), {}, tmp_path / "w")
    assert (ei.value.failure_class, ei.value.exit_code) == (FAILURE_EXIT, 127) and "/no/such/command" in ei.value.message


async def test_many_attempts_at_once_each_see_their_own_exit(tmp_path: Path) -> None:
    """Every exit is seen while others are still running or starting (an exit watcher that forgot
    the children it watched when the next one started left tasks running for ever)."""
    b = ProcessBackend()
    env = {"PATH": os.environ["PATH"]}
    # started one after another while the earlier ones still run; they end in the reverse order
    handles = [await b.start(spec("sh", "-c", f"sleep 0.{9 - i}; exit {i}"), env, tmp_path / f"w{i}") for i in range(8)]
    results = await asyncio.wait_for(asyncio.gather(*(b.wait(h, Output()) for h in handles)), 30)
    assert [r.exit_code for r in results] == list(range(8))
    for h in handles:
        await b.destroy(h)


async def test_a_slow_sink_gets_every_byte_in_order_and_the_agent_holds_little_of_it(tmp_path: Path) -> None:
    """The output of a task is read only as fast as the sink takes it: while the sink is held, the
    command blocks on its writes instead of the agent reading its whole output into memory."""
    b = ProcessBackend()
    size = 4 * 1024 * 1024
    script = f"import sys; sys.stdout.buffer.write(bytes(i % 251 for i in range({size}))); sys.stdout.flush()"
    h = await b.start(spec(sys.executable, "-c", script), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    held = asyncio.Event()
    got = bytearray()

    async def sink(stream: str, data: bytes) -> None:
        assert stream == "stdout"
        got.extend(data)
        await held.wait()

    waiter = asyncio.create_task(b.wait(h, sink))
    async with asyncio.timeout(30):  # the interpreter's start, however slow the machine
        while not got:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)  # what an unbounded reader would take meanwhile: all 4 MiB, in milliseconds
    # one chunk taken, a little buffered, the pipe full: the writer is still writing
    assert 0 < len(got) < size and not waiter.done()
    assert os.waitpid(int(h.ref), os.WNOHANG) == (0, 0)
    held.set()
    res = await asyncio.wait_for(waiter, 30)
    assert res.exit_code == 0 and bytes(got) == bytes(i % 251 for i in range(size))
    await b.destroy(h)


async def test_a_command_that_closes_its_output_is_waited_for_until_it_exits(tmp_path: Path) -> None:
    b = ProcessBackend()
    h = await b.start(spec("sh", "-c", "exec >/dev/null 2>&1; sleep 0.5; exit 3"), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    t0 = time.monotonic()
    res = await asyncio.wait_for(b.wait(h, Output()), 30)
    assert res.exit_code == 3 and time.monotonic() - t0 >= 0.4
    await b.destroy(h)


async def test_what_a_command_leaves_running_writes_after_its_exit_is_read_too(tmp_path: Path) -> None:
    """A short command's output is read once it has exited, all at once; a process it left behind
    holding its output is read from as it writes, and the wait lasts until that one closes it."""
    b = ProcessBackend()
    script = "echo early; echo warned >&2; (sleep 0.3; echo late) &"
    h = await b.start(spec("sh", "-c", script), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    out = Output()
    t0 = time.monotonic()
    res = await asyncio.wait_for(b.wait(h, out), 30)
    assert res.exit_code == 0 and time.monotonic() - t0 >= 0.25
    assert out.data == {"stdout": b"early\nlate\n", "stderr": b"warned\n"}
    await b.destroy(h)


async def test_a_command_inherits_no_descriptor_of_the_agent(tmp_path: Path) -> None:
    """A task holding one of the agent's descriptors could keep the fence keeper's pipe open after
    the agent died (and the keeper would never kill it): it gets its stdin, stdout and stderr only,
    even where the agent has a descriptor it could inherit."""
    r, w = os.pipe()
    os.set_inheritable(w, True)
    try:
        b = ProcessBackend()
        h = await b.start(spec("sh", "-c", "exec ls /proc/self/fd"), {"PATH": os.environ["PATH"]}, tmp_path / "w")
        out = Output()
        res = await asyncio.wait_for(b.wait(h, out), 30)
    finally:
        os.close(r)
        os.close(w)
    # ls's own: 0, 1, 2 and the directory it lists
    assert res.exit_code == 0 and sorted(int(fd) for fd in out.data["stdout"].split()) == [0, 1, 2, 3]
    await b.destroy(h)


async def test_every_command_reads_an_empty_stdin(tmp_path: Path) -> None:
    """A command's stdin is /dev/null (the agent keeps one descriptor of it for every start): `cat`
    reads nothing and ends, for the second command as for the first (the first start did not close
    the agent's descriptor), and the agent's descriptor is not among the command's. The agent's own
    stdin here is a pipe with something in it, which a command given the agent's stdin would print."""
    saved = os.dup(0)
    r, w = os.pipe()
    os.write(w, b"the agent's own stdin\n")
    os.close(w)
    os.dup2(r, 0)
    os.close(r)
    try:
        b = ProcessBackend()
        for i in range(2):
            script = "cat; readlink /proc/self/fd/0; ls /proc/self/fd"
            h = await b.start(spec("sh", "-c", script), {"PATH": os.environ["PATH"]}, tmp_path / f"w{i}")
            out = Output()
            res = await asyncio.wait_for(b.wait(h, out), 30)
            lines = out.data["stdout"].decode().split()
            assert res.exit_code == 0 and lines[0] == "/dev/null", out.data
            assert sorted(int(fd) for fd in lines[1:]) == [0, 1, 2, 3]  # ls's own directory: 3
            await b.destroy(h)
    finally:
        os.dup2(saved, 0)
        os.close(saved)


async def test_a_wait_cancelled_leaves_the_exit_for_the_stop_that_follows(tmp_path: Path) -> None:
    """The agent's attempt task cancelled while it waits (the agent shutting down) still stops the
    command and reaps it: the exit is not lost with the cancelled waiter (here it waits for the exit: the output is closed)."""
    b = ProcessBackend()
    h = await b.start(spec("sh", "-c", "echo ready; exec sleep 30 >/dev/null 2>&1"), {"PATH": os.environ["PATH"]}, tmp_path / "w")
    out = Output()
    waiter = asyncio.create_task(b.wait(h, out))
    async with asyncio.timeout(30):
        while b"ready" not in out.data["stdout"]:
            await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(b.stop(h, kill_grace=5.0), 10)  # SIGTERM ends sleep at once: no grace spent
    await b.destroy(h)
    with pytest.raises(ProcessLookupError):
        os.killpg(int(h.ref), 0)


async def test_without_pidfds_the_exits_are_still_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.3 (or a sandbox that refuses pidfd_open): a thread waits for each exit."""

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    b = ProcessBackend()
    env = {"PATH": os.environ["PATH"]}
    # each closes its output at once: its exit is all there is to wait for
    script = "exec >/dev/null 2>&1; sleep 0.{}; exit {}"
    handles = [await b.start(spec("sh", "-c", script.format(3 - i, i)), env, tmp_path / f"w{i}") for i in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*(b.wait(h, Output()) for h in handles)), 30)
    assert [r.exit_code for r in results] == [0, 1, 2]
    for h in handles:
        await b.destroy(h)


async def test_a_start_out_of_descriptors_gives_back_what_it_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node out of descriptors fails the start with the error, and leaks none of its own (a leak
    there would keep the node out of them for good)."""
    from podium.agent.process_backend import ProcessRun

    real_pipe, calls = os.pipe, []

    def second_fails() -> tuple[int, int]:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(24, "Too many open files")
        return real_pipe()

    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pipe", second_fails)
    with pytest.raises(OSError, match="Too many open files"):
        await ProcessRun(["true"], {"PATH": os.environ["PATH"]}, tmp_path / "w").start()
    monkeypatch.undo()
    assert len(calls) == 2 and sorted(os.listdir("/proc/self/fd")) == before


def tool(d: Path, name: str, says: str, mode: int = 0o755) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / name
    f.write_text(f"#!/bin/sh\necho {says}\n")
    f.chmod(mode)
    return f


async def run_out(b: ProcessBackend, env: dict[str, str], workdir: Path, *command: str) -> tuple[int | None, bytes]:
    h = await b.start(spec(*command), env, workdir)
    out = Output()
    res = await b.wait(h, out)
    await b.destroy(h)
    return res.exit_code, out.data["stdout"]


def test_a_command_is_found_where_the_childs_own_search_would_find_it(tmp_path: Path) -> None:
    """The first directory of PATH holding an executable file of that name; a directory of that name
    or a file no one may run is passed over, as `execve` fails on them and the search goes on."""
    from podium.agent import process_backend as pb

    pb._found.clear()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    (a / "tool").mkdir(parents=True)  # a directory of that name
    tool(b, "tool", "b", mode=0o644)  # not executable
    wanted = tool(c, "tool", "c")
    assert pb.executable("tool", f"{a}:{b}:{c}") == str(wanted)
    assert pb.executable("nothing-of-that-name", f"{a}:{b}:{c}") is None  # the child reports it
    assert pb.executable("./tool", f"{c}") is None and pb.executable(f"{c}/tool", f"{a}") is None  # paths run as given
    # an empty or relative entry before the hit means the child's working directory: not for us to say
    assert pb.executable("tool", f"{a}::{c}") is None and pb.executable("tool", f"rel:{c}") is None
    assert pb.executable("tool", f"{c}:rel") == str(wanted)
    # kept for LOOKUP_TTL: one installed earlier in PATH meanwhile is found once that has passed
    newer = tool(b, "tool", "b, runnable now")
    assert pb.executable("tool", f"{a}:{b}:{c}") == str(wanted)
    key = (f"{a}:{b}:{c}", "tool")
    pb._found[key] = (pb._found[key][0], time.monotonic() - 0.001)  # as if the second had passed
    assert pb.executable("tool", f"{a}:{b}:{c}") == str(newer)


async def test_a_command_found_is_run_under_its_own_name_and_looked_for_again_when_gone(tmp_path: Path) -> None:
    from podium.agent import process_backend as pb

    pb._found.clear()
    one, two = tmp_path / "one", tmp_path / "two"
    first = tool(one, "tool", "one")
    tool(two, "tool", "two")
    b = ProcessBackend()
    env = {"PATH": f"{one}:{two}:{os.environ['PATH']}"}
    assert await run_out(b, env, tmp_path / "w1", "tool") == (0, b"one\n")
    # argv[0] is the name the spec gave, not the path it was found at
    assert await run_out(b, env, tmp_path / "w2", "sh", "-c", 'echo "$0"') == (0, b"sh\n")
    # removed while its place is kept: the start still finds the next one, as the child's search would
    first.unlink()
    assert pb._found[(env["PATH"], "tool")][0] == str(first)
    assert await run_out(b, env, tmp_path / "w3", "tool") == (0, b"two\n")
    # and none at all is still the exit a shell gives
    with pytest.raises(StartFailed) as ei:
        await b.start(spec("no-such-tool-anywhere"), env, tmp_path / "w5")
    assert ei.value.exit_code == 127
