"""Every clock Podium runs on, in one value, so a test can shrink them all together and an operator
reading the code finds the whole policy in one place.

The defaults are the seed's canonical numbers: heartbeat every 10s, unreachable at 30s, offline at
120s, a 15s provisioning deadline, a 30s SIGTERM→SIGKILL grace on the node and 60s before the server
gives up waiting for a cancelled task's node. `PODIUM_TEST_FAST_TIMERS=1` divides every duration by
ten (`FAST_TIMER_DIVISOR`); `claim_limit`, `place_limit` and `assign_window` are counts, not durations (`COUNTS`),
and are never touched.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

FAST_TIMERS_ENV = "PODIUM_TEST_FAST_TIMERS"
FAST_TIMER_DIVISOR = 10
# With fast timers, a test may choose a gentler divisor for every process it starts: one whose
# processes are slowed on purpose (a clock library preloaded into them) still has to meet each
# deadline it asserts on, on a busy machine too.
TIMER_DIVISOR_ENV = "PODIUM_TEST_TIMER_DIVISOR"

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True, slots=True)
class Timing:
    """All durations are in seconds."""

    # How often queued work is claimed. A NOTIFY on "task queued" beats it for fresh submissions;
    # this is the backstop.
    tick: float = 1.0
    # How often leases, timeouts, cancels and node health are swept.
    watchdog: float = 1.0
    # An assignment's lease until the task has proved it is being worked on.
    lease_ttl: float = 300.0
    # How long a node has, after Assign, to say provisioning; past it the assignment is revoked.
    provisioning_deadline: float = 15.0
    # Added to the spec's timeout to give a running task's lease its expiry, so a lease never
    # expires under a task that is still legitimately running.
    lease_grace: float = 60.0
    # Agent → server heartbeat period.
    heartbeat: float = 10.0
    # No heartbeat this long: node unreachable. Its tasks keep running.
    unreachable_after: float = 30.0
    # No heartbeat this long: node offline, its leases expire, the node-loss policy applies.
    offline_after: float = 120.0
    # SIGTERM → SIGKILL on the node.
    kill_grace: float = 30.0
    # After a cancel, how long the server waits for the node before writing the end itself.
    cancel_grace: float = 60.0
    # A registry that cannot be reached is asked again after this long, doubled per failed try up to
    # registry_retry_max; the task waits queued meanwhile, with the reason.
    registry_retry: float = 2.0
    registry_retry_max: float = 60.0
    # How often every live attempt is rechecked against what its node last said (the reconcile
    # loop), and how long a replica's claim on the attempts it is checking lasts: a replica that dies
    # holding claims loses them at the expiry, and another replica checks those attempts.
    reconcile: float = 30.0
    reconcile_claim: float = 60.0
    # How many queued tasks the once-a-tick look at the whole window considers, each told its true
    # reason. A count, not a duration.
    claim_limit: int = 512
    # How many queued tasks one dispatch pass may claim and place while the fleet has room for them.
    # A pass costs its round trips whatever its size, each waiting its turn on a busy event loop: on
    # 5,000 nodes with a backlog, passes of 512 came back to back every ~250 ms and bounded
    # placement; passes of 1,024 placed a fifth more a second (docs/benchmarks.md). A count.
    place_limit: int = 1024
    # How many assignments may wait for their node's "provisioning" at once, over the whole fleet.
    # Past it the dispatcher waits: placing faster than the nodes' reports can be recorded only
    # builds a backlog in which healthy nodes miss their accept deadlines. A count, not a duration.
    assign_window: int = 4096

    def scaled(self, divisor: float) -> Timing:
        """Every duration divided by `divisor`; the counts untouched."""
        changes = {f.name: getattr(self, f.name) / divisor for f in dataclasses.fields(self) if f.name not in COUNTS}
        return dataclasses.replace(self, **changes)


# the fields of Timing that are counts, not durations: fast timers leave them as they are
COUNTS = ("claim_limit", "place_limit", "assign_window")

DEFAULT_TIMING = Timing()


def fast_timers_enabled(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(FAST_TIMERS_ENV, "").strip().lower() in _TRUE


def timing_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> Timing:
    """DEFAULT_TIMING, shrunk tenfold when PODIUM_TEST_FAST_TIMERS says so.

    Called once at process start; the result is passed down, never re-read.
    """
    env = os.environ if environ is None else environ
    if fast_timers_enabled(env):
        return DEFAULT_TIMING.scaled(_divisor(env.get(TIMER_DIVISOR_ENV, "")))
    return DEFAULT_TIMING


def _divisor(raw: str) -> float:
    if not raw.strip():
        return FAST_TIMER_DIVISOR
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 1000:
        raise ValueError(f"{TIMER_DIVISOR_ENV}={raw!r} must be a number from 1 to 1000 (how many times faster every timer runs)")
    return value
