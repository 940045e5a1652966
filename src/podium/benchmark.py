"""`podium bench`: how fast a server and its fleet run real commands, measured through the API only,
so a user can run it against their own server and compare it with other schedulers.

Two modes, both optional:
- a burst: `tasks` commands submitted in batches (`POST /v1/tasks/batch`), all waited for; tasks per
  second from the first submit to the last end the API reported, and submit → `running` and submit →
  `succeeded` percentiles; and the two parts of that rate: when the first task ended (how long the
  scheduler took to fill its pipeline) and the rate from then to the last end (how fast it flows);
- one at a time (`serial`): each task submitted only after the previous one ended. With the default
  command (`date +%s.%N`) the task itself writes when its first instruction ran, read back from its
  logs: submit → first instruction. That figure compares this machine's clock with the node's, so it
  is exact only when the agent runs on the same host (or the clocks are synchronised).

Every time is the client's: a task is `running` or `succeeded` when this process read that event on
the server's event stream (`GET /v1/events`), which is what any API client would see. Submit time is
taken just before the POST that carries the task. If the stream is lost the remaining tasks are
polled, and the report says so.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podium.client import Client, PodiumError

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "lost"})
TIMESTAMP_COMMAND = ["date", "+%s.%N"]  # prints the time its first instruction ran (well, date's main)
BENCH_NAME = "podium-bench"
OVERLOAD_PATIENCE = 120.0  # seconds a refused (429) submission is sent again, as the server asks


@dataclass
class _Seen:
    """What the stream said about one task, in this process's monotonic clock."""

    running: float | None = None
    ended: float | None = None
    state: str | None = None


@dataclass
class _Watch:
    """The server's task events, followed in a thread from before the first submission."""

    client: Client
    seen: dict[str, _Seen] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    opened: threading.Event = field(default_factory=threading.Event)
    lost: str | None = None  # why the stream ended early, if it did
    # the tasks a waiter still waits for: it is woken once, when the last of them ends, not on every
    # event (a scan of a thousand ids on each of five thousand events was most of this client's CPU)
    awaiting: set[str] = field(default_factory=set)
    _stop: bool = False
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def start(self, timeout: float = 30.0) -> None:
        self._thread = threading.Thread(target=self._follow, name="bench-events", daemon=True)
        self._thread.start()
        # the server fixes the stream's starting point when it answers: events after that are ours
        if not self.opened.wait(timeout) and self.lost is None:
            self.lost = f"the event stream did not open within {timeout:g}s"

    def stop(self) -> None:
        self._stop = True
        self.client.close()  # ends the blocking read

    def _follow(self) -> None:
        try:
            # only what the figures need: a stream of every state a task passes through would cost
            # the server and this client three events more a task
            for e in self.client.events(kind="task", state=("running", *sorted(TERMINAL)), on_open=self.opened.set):
                self._note(e.task_id, e.state)
        except Exception as e:  # noqa: BLE001 - any end of the stream: the waiter polls instead
            if not self._stop:
                with self.lock:
                    self.lost = f"the event stream ended: {e}"
                    self.changed.notify_all()
        finally:
            self.opened.set()

    def _note(self, tid: str | None, state: str | None) -> None:
        if not tid or not state:
            return
        now = time.monotonic()
        with self.lock:
            s = self.seen.setdefault(tid, _Seen())
            if state == "running" and s.running is None:
                s.running = now
            if state in TERMINAL and s.ended is None:
                s.ended, s.state = now, state
                if tid in self.awaiting:
                    self.awaiting.discard(tid)
                    if not self.awaiting:
                        self.changed.notify_all()

    def wait(self, ids: set[str], deadline: float, poll: Callable[[str], tuple[str, bool]]) -> None:
        """Until every task of `ids` has ended (by the stream, or by polling once it is lost)."""
        with self.lock:
            self.awaiting = {t for t in ids if t not in self.seen or self.seen[t].ended is None}
        while True:
            with self.lock:
                left = list(self.awaiting)
                if not left:
                    return
                if self.lost is None:
                    if time.monotonic() > deadline:
                        raise PodiumError(f"{len(left)} tasks had not ended by the deadline")
                    self.changed.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
            for tid in left:  # the stream is gone: ask each task (the time is then the poll's)
                state, terminal = poll(tid)
                if terminal:
                    with self.lock:
                        s = self.seen.setdefault(tid, _Seen())
                        s.ended, s.state = time.monotonic(), state
                        self.awaiting.discard(tid)
            if time.monotonic() > deadline:
                raise PodiumError("tasks had not ended by the deadline")
            time.sleep(0.05)


def percentile(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


def _ms(values: list[float]) -> dict[str, float | None]:
    xs = sorted(v * 1000 for v in values)
    return {"p50": _round(percentile(xs, 50)), "p99": _round(percentile(xs, 99)), "n": len(xs)}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


class Bench:
    """Runs the modes against one server through `podium.client.Client` (found as every client finds it)."""

    def __init__(self, addr: str | None = None, token: str | None = None, command: list[str] | None = None,
                 timeout: float = 600.0) -> None:  # fmt: skip
        self.addr, self.token = addr, token
        self.client = Client(addr, token, timeout=60.0)
        self.command = list(command) if command else None
        self.timeout = timeout

    def close(self) -> None:
        self.client.close()

    def _spec(self, command: list[str]) -> dict[str, Any]:
        return {"name": BENCH_NAME, "command": command}

    def _submit_many(self, specs: list[dict[str, Any]]) -> list[str]:
        give_up = time.monotonic() + OVERLOAD_PATIENCE
        while True:
            try:
                return [t.id for t in self.client.submit_many(specs)]
            except PodiumError as e:
                # 429: an overloaded server stored nothing and asks to be asked again later
                if e.status != 429 or time.monotonic() > give_up:
                    raise
                time.sleep(0.1)

    def _poll(self, tid: str) -> tuple[str, bool]:
        t = self.client.task(tid)
        return t.state, t.terminal

    def _watch(self) -> _Watch:
        w = _Watch(Client(self.addr, self.token, timeout=60.0))
        w.start()
        return w

    def burst(self, tasks: int, batch: int = 100) -> dict[str, Any]:
        command = self.command or ["true"]
        watch = self._watch()
        submitted: dict[str, float] = {}
        try:
            t0 = time.monotonic()
            for i in range(0, tasks, batch):
                n = min(batch, tasks - i)
                q = time.monotonic()
                for tid in self._submit_many([self._spec(command)] * n):
                    submitted[tid] = q
            t_sub = time.monotonic()
            watch.wait(set(submitted), t0 + self.timeout, self._poll)
        finally:
            watch.stop()
        seen = {tid: watch.seen[tid] for tid in submitted}
        ended = sorted(s.ended for s in seen.values() if s.ended is not None)
        first, last = ended[0], ended[-1]
        ends: dict[str, int] = {}
        for s in seen.values():
            ends[s.state or "?"] = ends.get(s.state or "?", 0) + 1
        return {
            "mode": "burst", "tasks": tasks, "batch": batch, "command": command,
            "seconds": round(last - t0, 3), "tasks_per_s": round(tasks / (last - t0), 1),
            "submit_seconds": round(t_sub - t0, 3), "ends": ends,
            "first_end_ms": round((first - t0) * 1000, 1),
            # the other tasks over the time from the first end to the last (None: they ended at once)
            "after_first_end_per_s": round((tasks - 1) / (last - first), 1) if tasks > 1 and last > first else None,
            # the longest the burst then went with no task ending: a scheduler that idles (a lost
            # wake-up waited out until a timer) shows here long before it shows in the rate
            "longest_pause_ms": round(max((b - a for a, b in itertools.pairwise(ended)), default=0.0) * 1000, 1),
            "submit_to_running_ms": _ms([s.running - submitted[t] for t, s in seen.items() if s.running is not None]),
            "submit_to_succeeded_ms": _ms([s.ended - submitted[t] for t, s in seen.items()
                                           if s.ended is not None and s.state == "succeeded"]),
            "stream_lost": watch.lost,
        }  # fmt: skip

    def serial(self, count: int) -> dict[str, Any]:
        command = self.command or TIMESTAMP_COMMAND
        timestamped = self.command is None
        watch = self._watch()
        running: list[float] = []
        succeeded: list[float] = []
        first: list[float] = []
        ends: dict[str, int] = {}
        try:
            t0 = time.monotonic()
            for _ in range(count):
                wall, q = time.time(), time.monotonic()
                tid = self._submit_many([self._spec(command)])[0]
                watch.wait({tid}, q + self.timeout, self._poll)
                s = watch.seen[tid]
                ends[s.state or "?"] = ends.get(s.state or "?", 0) + 1
                if s.running is not None:
                    running.append(s.running - q)
                if s.state == "succeeded" and s.ended is not None:
                    succeeded.append(s.ended - q)
                    if timestamped:
                        out = "".join(c.data for c in self.client.logs(tid)).strip()
                        # not a timestamp: the figure is left out, the count shows it
                        with contextlib.suppress(ValueError, IndexError):
                            first.append(float(out.split()[0]) - wall)
            seconds = time.monotonic() - t0
        finally:
            watch.stop()
        result = {
            "mode": "serial", "tasks": count, "command": command, "seconds": round(seconds, 3),
            "tasks_per_s": round(count / seconds, 1), "ends": ends,
            "submit_to_running_ms": _ms(running), "submit_to_succeeded_ms": _ms(succeeded),
            "stream_lost": watch.lost,
        }  # fmt: skip
        if timestamped:
            result["submit_to_first_instruction_ms"] = _ms(first)
        return result

    def warm_up(self, tasks: int) -> None:
        """Tasks run before any timing: every node's first fork, imports and connections are paid."""
        if tasks <= 0:
            return
        ids = set(self._submit_many([self._spec(["true"])] * tasks))
        deadline = time.monotonic() + self.timeout
        while ids:
            ids = {t for t in ids if not self._poll(t)[1]}
            if ids and time.monotonic() > deadline:
                raise PodiumError(f"{len(ids)} warm-up tasks had not ended within {self.timeout:g}s")
            time.sleep(0.05)
