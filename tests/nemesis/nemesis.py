"""Faults at random, from a seed: the schedule (which fault, where, for how long) is drawn from
`random.Random(seed)` alone, so a printed seed replays the same campaign of faults.

Each fault is applied at once and healed after its own duration; at most two are active at once,
and at most one replica is harmed at a time (a fleet with both replicas down only tests patience).
`heal_all` undoes everything still active: the checker judges the fleet only after it.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.nemesis.fleet import Fleet, faketime_lib

KINDS = ("link-down", "drop-in", "drop-out", "delay", "loss", "replica-db-cut", "agent-stop", "agent-kill",
         "replica-kill", "pg-terminate", "pg-restart", "replica-clock-skew", "disk-slow")  # fmt: skip
REPLICA_KINDS = {"replica-db-cut", "replica-kill", "replica-clock-skew"}


@dataclass
class Active:
    kind: str
    target: str
    heal_at: float
    heal: Callable[[], None]


class Nemesis:
    def __init__(self, fleet: Fleet, seed: int, interval: tuple[float, float] = (1.0, 4.0),
                 duration: tuple[float, float] = (1.0, 6.0), long: tuple[float, float] = (10.0, 25.0),
                 kinds: tuple[str, ...] = KINDS, log: Any = print) -> None:  # fmt: skip
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.interval, self.duration, self.long = interval, duration, long
        self.kinds = tuple(k for k in kinds if (k != "replica-clock-skew" or faketime_lib())
                           and (k != "pg-restart" or fleet.own_pg is not None)
                           and (k != "disk-slow" or fleet.slow_disk is not None))  # fmt: skip
        self.log = log
        self.faults: Counter[str] = Counter()
        self.active: list[Active] = []
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self.t0 = time.monotonic()
        self.errors: list[str] = []

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(120)

    def _say(self, what: str) -> None:
        self.log(f"[{time.monotonic() - self.t0:7.2f}s] nemesis: {what}")

    def _run(self) -> None:
        next_at = time.monotonic() + self.rng.uniform(*self.interval)
        while not self.stop_ev.wait(0.1):
            now = time.monotonic()
            for a in [a for a in self.active if a.heal_at <= now]:
                self._heal(a)
            if now < next_at:
                continue
            next_at = now + self.rng.uniform(*self.interval)
            # draw every choice even when it is not used, so the schedule depends on the seed alone
            kind = self.rng.choice(self.kinds)
            host = self.rng.randrange(len(self.fleet.hosts))
            rep = self.rng.randrange(len(self.fleet.replicas))
            # most faults are short; some outlast OfflineAfter, so nodes are given up on, tasks requeued
            # or lost, and fence keepers must have stopped them first
            dur = self.rng.uniform(*self.duration) if self.rng.random() < 0.65 else self.rng.uniform(*self.long)
            x = self.rng.random()
            if len(self.active) >= 2:
                continue
            if kind in REPLICA_KINDS and any(a.kind in REPLICA_KINDS for a in self.active):
                continue
            h, r = self.fleet.hosts[host], self.fleet.replicas[rep]
            if any(a.target in (h.name, r.name) for a in self.active):
                continue
            if kind == "pg-restart" and any(a.kind == "disk-slow" for a in self.active):
                continue  # a shutdown checkpoint on a throttled disk can outlast pg_ctl's wait
            try:
                heal = self._apply(kind, h, r, x)
            except Exception as e:  # a fault that cannot be applied is reported, never fatal
                self.errors.append(f"{kind}: {e}")
                continue
            self.faults[kind] += 1
            target = r.name if kind in REPLICA_KINDS else ("postgres" if kind.startswith("pg-") or kind == "disk-slow" else h.name)
            self._say(f"{kind} {target} for {dur:.1f}s")
            if heal is not None:
                self.active.append(Active(kind, target, time.monotonic() + dur, heal))

    def _apply(self, kind: str, h: Any, r: Any, x: float) -> Callable[[], None] | None:
        f, net, hub = self.fleet, self.fleet.net, self.fleet.hub
        assert net is not None
        if kind == "link-down":
            net.link(h.net, False)
            return lambda: net.link(h.net, True)
        if kind in ("drop-in", "drop-out"):
            net.drop(h.net, kind[5:])
            return lambda: net.undrop(h.net)
        if kind == "delay":
            for link in h.links:
                hub.shape(link, delay=0.05 + x * 0.5)
            return lambda: [hub.heal(link) for link in h.links] and None
        if kind == "loss":
            for link in h.links:
                hub.shape(link, loss=0.1 + x * 0.3)
            return lambda: [hub.heal(link) for link in h.links] and None
        if kind == "replica-db-cut":
            hub.cut(r.db_link)
            return lambda: hub.heal(r.db_link)
        if kind == "agent-stop":
            h.proc.signal(signal.SIGSTOP)
            return lambda: h.proc.signal(signal.SIGCONT)
        if kind == "agent-kill":
            h.proc.kill()
            return h.proc.start
        if kind == "replica-kill":
            r.proc.kill()
            return lambda: f.start_replica(r, wait=False)
        if kind == "pg-terminate":
            asyncio.run(f.terminate_connections())
            return None
        if kind == "pg-restart":
            assert f.own_pg is not None
            f.own_pg.restart()
            return None
        if kind == "disk-slow":
            # 10–100 I/Os a second (a commit's WAL flush takes about three), 1–4 MiB/s
            assert f.slow_disk is not None
            iops, bps = int(10 + x * 90), int((1 + x * 3) * 2**20)
            n = f.slow_disk.slow(iops, bps)
            self._say(f"postgres's disk throttled to {iops} I/Os and {bps >> 20} MiB a second ({n} processes)")
            return f.slow_disk.heal
        if kind == "replica-clock-skew":
            skew = ("+" if x < 0.5 else "-") + f"{int(30 + x * 270)}s"
            r.proc.stop()
            f.start_replica(r, skew=skew, wait=False)
            self._say(f"{r.name} restarted with its clock {skew}")

            def unskew() -> None:
                r.proc.stop()
                f.start_replica(r, wait=False)

            return unskew
        raise ValueError(kind)

    def _heal(self, a: Active) -> None:
        self.active.remove(a)
        try:
            a.heal()
            self._say(f"healed {a.kind} {a.target}")
        except Exception as e:
            self.errors.append(f"heal {a.kind} {a.target}: {e}")

    def heal_all(self) -> None:
        for a in list(self.active):
            self._heal(a)
        # belt and braces: whatever a failed heal left behind
        f = self.fleet
        assert f.net is not None
        for h in f.hosts:
            f.net.link(h.net, True)
            f.net.undrop(h.net)
            for link in h.links:
                f.hub.heal(link)
            if h.proc.stopped:
                h.proc.signal(signal.SIGCONT)
            if not h.proc.alive():
                h.proc.start()
        if f.slow_disk is not None:
            f.slow_disk.heal()
        for r in f.replicas:
            f.hub.heal(r.db_link)
            if r.skew is not None:
                r.proc.stop()
            if not r.proc.alive():
                f.start_replica(r, wait=False)
        for r in f.replicas:
            f.wait_ready(r)
