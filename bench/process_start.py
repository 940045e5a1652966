"""What one task's process start costs the agent (issue 17): CPU of this process, and of the child,
per start of `true` with both output pipes read and its exit waited for, two ways in turn:

- `asyncio`: asyncio's subprocess transports (`create_subprocess_exec`, StreamReaders, the pidfd child
  watcher), as the agent started tasks until the eleventh session;
- `ProcessRun`: the agent's own (agent/process_backend.py): `subprocess.Popen`, the pipes read straight
  off the loop, the exit learnt from a pidfd.

    .venv/bin/python bench/process_start.py [--starts 500] [--rounds 3]

Both run in the same process, one after the other, each round: compare within a round only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from podium.agent.process_backend import ProcessRun  # noqa: E402

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


async def with_asyncio(workdir: Path) -> None:
    p = await asyncio.create_subprocess_exec(
        "true", cwd=str(workdir), env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    await asyncio.gather(p.stdout.read(), p.stderr.read())
    await p.wait()


async def with_process_run(workdir: Path) -> None:
    async def sink(_stream: str, _data: bytes) -> None:
        return None

    run = ProcessRun(["true"], ENV, workdir)
    await run.start()
    await run.wait(sink)


async def measure(how: str, starts: int, workdir: Path) -> tuple[float, float, float]:
    start = with_asyncio if how == "asyncio" else with_process_run
    if how == "asyncio" and sys.version_info < (3, 12) and hasattr(os, "pidfd_open"):
        with warnings.catch_warnings():  # the watcher 3.11's agent installed: no thread per child
            warnings.simplefilter("ignore", DeprecationWarning)
            watcher = asyncio.PidfdChildWatcher()
            asyncio.get_event_loop_policy().set_child_watcher(watcher)
            watcher.attach_loop(asyncio.get_running_loop())
    wall, cpu = time.perf_counter(), time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(starts):
        await start(workdir)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (after.ru_utime + after.ru_stime) - (kids.ru_utime + kids.ru_stime)
    return (time.perf_counter() - wall) / starts * 1e3, (time.process_time() - cpu) / starts * 1e3, child / starts * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="podium-process-start-") as tmp:
        for r in range(1, a.rounds + 1):
            for how in ("asyncio", "ProcessRun"):
                wall, cpu, child = asyncio.run(measure(how, a.starts, Path(tmp)))
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(f"round {r} · {how:10s} · {a.starts} starts · wall {wall:.3f} ms · this process {cpu:.3f} ms"
                      f" · child {child:.3f} ms a start · load {load}")  # fmt: skip


if __name__ == "__main__":
    main()
