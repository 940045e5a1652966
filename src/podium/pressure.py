"""Admission control: when the server is behind on its own work, it refuses new submissions (429 with
Retry-After) instead of accepting work at the expense of the nodes it already serves.

One asyncio event loop does everything in a server: the API, placement, and every node's stream.
Accepting submissions faster than they can be placed does not make anything run sooner — the queue is
durable and placement bounded — but each accepted request takes event-loop time that heartbeats and
node reports then wait for. So the server watches two signs that it is behind: how late its event loop
runs a timer due now (smoothed), and how many node reports wait for a group commit. Past either limit,
submissions are shed until it catches up. Reads, cancels and node traffic are never shed.

Lag alone is not enough: on a machine shared with other busy processes the loop runs late because it
is not given a core, and refusing work then helps nobody. So lag counts only while the server itself
is busy (its CPU time over the same interval is most of a core): behind *because of its own work*.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from podium.errors import Overloaded

DEFAULT_MAX_LAG = 0.25  # seconds of smoothed event-loop lag past which submissions are refused
DEFAULT_MAX_BACKLOG = 20_000  # node reports waiting past which submissions are refused
MIN_BUSY = 0.7  # share of a core the server must be using for its lag to count as its own overload
SMOOTHING = 0.3  # weight of the newest probe in the moving averages
RETRY_AFTER = 1  # seconds a refused client is told to wait


@dataclass
class Pressure:
    max_lag: float = DEFAULT_MAX_LAG
    max_backlog: int = DEFAULT_MAX_BACKLOG
    backlog: Callable[[], int] = field(default=lambda: 0)  # node reports waiting, read when asked
    lag: float = 0.0  # smoothed event-loop lag, seconds
    busy: float = 0.0  # smoothed share of a core the server process used
    shed: int = 0  # submissions refused so far

    def observe(self, lag: float, busy: float) -> None:
        """One probe: how late the loop ran a timer (seconds) and the share of a core the process
        used since the last probe."""
        if not (math.isfinite(lag) and math.isfinite(busy)) or lag < 0 or busy < 0:
            return
        self.lag = SMOOTHING * lag + (1 - SMOOTHING) * self.lag
        self.busy = SMOOTHING * busy + (1 - SMOOTHING) * self.busy

    def why_overloaded(self) -> str | None:
        """None when submissions may be accepted; else the reason, for the client."""
        if self.lag > self.max_lag and self.busy >= MIN_BUSY:
            return (
                f"its event loop is {self.lag * 1000:.0f} ms behind (limit {self.max_lag * 1000:.0f} ms) "
                f"while using {self.busy:.0%} of a core"
            )
        waiting = self.backlog()
        if waiting > self.max_backlog:
            return f"{waiting:,} node reports are waiting to be recorded (limit {self.max_backlog:,})"
        return None

    def admit(self, count: int = 1) -> None:
        """Raise Overloaded if the server is too far behind to take `count` more submissions."""
        why = self.why_overloaded()
        if why is not None:
            self.shed += count
            raise Overloaded(
                f"the server is overloaded: {why}; nothing was stored. Retry after {RETRY_AFTER}s "
                "(with the same idempotency key to be safe); the tasks already queued are not affected",
                retry_after=RETRY_AFTER,
            )
