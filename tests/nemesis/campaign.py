"""A nemesis campaign from end to end: build the fleet, run the workload while the nemesis injects
faults, heal everything, let the fleet settle, check, print the report, tear everything down.

    python -m tests.nemesis.campaign --minutes 10 --seed 42      (scripts/nemesis wraps this)

The report's last line is `anomalies: N`; the exit status is 0 only when N is 0. The seed is printed
first: the same seed gives the same schedule of faults and the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.nemesis.checker import TERMINAL, Verdict, check
from tests.nemesis.fleet import Fleet
from tests.nemesis.nemesis import KINDS, Nemesis
from tests.nemesis.workload import Workload, read_truth


@dataclass
class Result:
    seed: int
    verdict: Verdict
    ops: Counter[str]
    faults: Counter[str]
    report: str
    soak: list[str] = field(default_factory=list)

    @property
    def anomalies(self) -> int:
        return len(self.verdict.anomalies)


class Soak:
    """Every `period` seconds: each replica's and agent's RSS, open fds and threads, and the run
    database's connections."""

    def __init__(self, fleet: Fleet, period: float, log: Any) -> None:
        self.fleet, self.period, self.log = fleet, period, log
        self.rows: list[str] = []
        self.stop_ev = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="nemesis-soak", daemon=True)

    def start(self) -> None:
        self.sample()
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(30)
        self.sample()

    def _run(self) -> None:
        while not self.stop_ev.wait(self.period):
            self.sample()

    def sample(self) -> None:
        cells = []
        for p in [*self.fleet.replicas, *self.fleet.hosts]:
            try:
                ps = psutil.Process(p.proc.pid)
                cells.append(f"{p.name} {ps.memory_info().rss / 2**20:.0f}M/{ps.num_fds()}fd/{ps.num_threads()}t")
            except (psutil.Error, AssertionError):
                cells.append(f"{p.name} -")
        try:
            dbc = str(asyncio.run(self.fleet.db_connections()))
        except Exception:
            dbc = "?"
        row = f"soak t={time.monotonic() - self.t0:6.0f}s db_conns={dbc} " + "  ".join(cells)
        self.rows.append(row)
        self.log(row)


def settle(fleet: Fleet, timeout: float, log: Any) -> bool:
    """Wait until every node is online and no task is on its way anywhere; False on the timeout."""

    async def busy() -> tuple[int, int]:
        conn = await fleet.connect_db()
        try:
            active = await conn.fetchval("SELECT count(*) FROM tasks WHERE state <> ALL($1::text[])", sorted(TERMINAL))
            online = await conn.fetchval("SELECT count(*) FROM nodes WHERE health = 'online' AND connected")
            return int(active), int(online)
        finally:
            await conn.close()

    # A backlog left by the workload drains at the fleet's pace: keep waiting while it shrinks, give
    # up after `timeout` without progress (or ten times that in all).
    start = time.monotonic()
    progress_at, best = start, None
    last = (-1, -1)
    while time.monotonic() - progress_at < timeout and time.monotonic() - start < 10 * timeout:
        try:
            last = asyncio.run(busy())
        except Exception as e:
            log(f"settle: {e}")
        if last[0] == 0 and last[1] == len(fleet.hosts):
            log(f"settled after {time.monotonic() - start:.1f}s")
            return True
        if last[0] >= 0 and (best is None or last[0] < best):
            best, progress_at = last[0], time.monotonic()
        time.sleep(0.5)
    log(f"settle: after {time.monotonic() - start:.0f}s still {last[0]} tasks not ended, {last[1]}/{len(fleet.hosts)} nodes online")
    return False


def run(seconds: float, seed: int, hosts: int = 3, rate: float = 3.0, soak_period: float = 0.0, pg: str = "embedded",
        settle_timeout: float = 60.0, root: Path | None = None, keep: bool = False, log: Any = print,
        probe: Any = None, fault_interval: tuple[float, float] = (1.0, 4.0)) -> Result:  # fmt: skip
    """`probe(fleet, record, truth)`, if given, runs after the check with the fleet still up (the
    suite uses it to show the checker catches what it claims to)."""
    log(f"nemesis seed: {seed}  (replay: scripts/nemesis --seconds {seconds:.0f} --seed {seed} --hosts {hosts} --rate {rate:g} --pg {pg})")
    own_root = root is None
    root = root or Path(tempfile.mkdtemp(prefix="podium-nemesis-"))
    fleet = Fleet(root, hosts=hosts, seed=seed, pg=pg, log=log)
    workload: Workload | None = None
    nemesis: Nemesis | None = None
    soak: Soak | None = None
    try:
        t0 = time.monotonic()
        fleet.start()
        deadline = time.monotonic() + 60
        while fleet.online_nodes() < hosts and time.monotonic() < deadline:
            time.sleep(0.2)
        log(f"fleet: {len(fleet.replicas)} replicas, {fleet.online_nodes()}/{hosts} agents online "
            f"after {time.monotonic() - t0:.1f}s; run dir {root}")
        workload = Workload(fleet, seed + 1, rate=rate, log=log)
        nemesis = Nemesis(fleet, seed, interval=fault_interval, log=log)
        if soak_period:
            soak = Soak(fleet, soak_period, log)
            soak.start()
        workload.start()
        nemesis.start()
        time.sleep(seconds)
        nemesis.stop()
        workload.stop()
        log("healing every fault")
        nemesis.heal_all()
        workload.undrain_due(everything=True)
        settled = settle(fleet, settle_timeout, log)
        # a process the store already ended may still be on its way down (SIGTERM → SIGKILL grace)
        time.sleep(1.0)
        if soak is not None:
            soak.stop()
        truth = read_truth(fleet.truth)

        async def judge() -> Verdict:
            conn = await fleet.connect_db()
            try:
                return await check(conn, workload.rec, truth)  # type: ignore[union-attr]
            finally:
                await conn.close()

        verdict = asyncio.run(judge())
        if probe is not None:
            probe(fleet, workload.rec, truth)
        if not settled:
            verdict.notes.append(("settle-timeout", f"the fleet made no progress for {settle_timeout:.0f}s"))
        report = _report(seed, seconds, workload.rec.ops, len(workload.rec.acks), nemesis.faults, nemesis.errors, verdict,
                         soak.rows if soak else [])  # fmt: skip
        log(report)
        return Result(seed, verdict, workload.rec.ops, nemesis.faults, report, soak.rows if soak else [])
    except BaseException:
        for p in [*fleet.replicas, *fleet.hosts]:
            log(f"==== {p.name}\n{p.proc.tail(2500)}")
        raise
    finally:
        for x in (nemesis, workload):
            if x is not None and x.thread.is_alive():
                x.stop()
        if workload is not None:
            workload.close()
        fleet.stop()
        if own_root and not keep:
            shutil.rmtree(root, ignore_errors=True)


def _report(seed: int, seconds: float, ops: Counter[str], acked: int, faults: Counter[str], errors: list[str],
            v: Verdict, soak: list[str]) -> str:  # fmt: skip
    out = [f"==== nemesis report (seed {seed}, {seconds:.0f}s of faults)", "operations:"]
    out += [f"  {k}: {n}" for k, n in sorted(ops.items())]
    out.append(f"  acknowledged submissions: {acked}")
    out.append(f"  attempts that really ran: {v.attempts_run}")
    out.append("final task states: " + ", ".join(f"{k} {n}" for k, n in sorted(v.states.items())))
    out += [f"  {k}: {n}" for k, n in sorted(v.reasons.items())]
    out.append("faults:")
    out += [f"  {k}: {faults.get(k, 0)}" for k in KINDS]
    out += [f"  (could not apply: {e})" for e in errors[:10]]
    if v.notes:
        out.append("notes (by design, not anomalies):")
        notes = Counter(k for k, _ in v.notes)
        out += [f"  {k}: {n}  e.g. {next(d for kk, d in v.notes if kk == k)}" for k, n in sorted(notes.items())]
    out.append("anomalies by kind:")
    out += [f"  {k}: {n}" for k, n in sorted(v.by_kind().items())] or ["  (none)"]
    out += [f"  - {k}: {d}" for k, d in v.anomalies[:30]]
    out.append(f"anomalies: {len(v.anomalies)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/nemesis", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--minutes", type=float, default=None, help="how long the nemesis runs (default 1)")
    ap.add_argument("--seconds", type=float, default=None, help="the same in seconds")
    ap.add_argument("--seed", type=int, default=None, help="replay a campaign (default: a random seed, printed)")
    ap.add_argument("--hosts", type=int, default=3, help="agent hosts, each in its own network namespace")
    ap.add_argument("--rate", type=float, default=2.0, help="client operations per second")
    ap.add_argument("--pg", choices=("embedded", "system"), default="embedded",
                    help="the harness's own PostgreSQL (restartable), or the system's on 127.0.0.1:5432")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs, ground truth)")
    a = ap.parse_args(argv)
    seconds = a.seconds if a.seconds is not None else 60 * (a.minutes if a.minutes is not None else 1)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    # the long run also watches for leaks: one sample a minute (and at the start and the end)
    res = run(seconds, seed, hosts=a.hosts, rate=a.rate, soak_period=60.0 if seconds >= 120 else 0.0, pg=a.pg,
              keep=a.keep, log=lambda s: print(s, flush=True))  # fmt: skip
    return 0 if res.anomalies == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
