"""The fence keeper's lapses, with a real keeper process and a real process group (nemesis seed
1414, docs/reliability.md): the lease runs out, the keeper SIGKILLs the attempt, and the
acknowledgement of a late heartbeat renews the lease before the agent has seen the exit. That exit
must still count as the fence's (retryable elsewhere), not as the task's own exit code 137."""

from __future__ import annotations

import subprocess
import time

from podium.agent.fence import FenceKeeper
from tests.harness import wait_for


def test_a_kill_by_the_fence_is_known_after_a_late_renewal() -> None:
    keeper = FenceKeeper(None)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = time.monotonic()
        keeper.renew(started + 0.3)
        keeper.add(proc.pid, "task", 7)
        wait_for(lambda: proc.poll() is not None, 30, what="the fence keeper to kill the attempt")
        assert proc.returncode == -9
        keeper.renew(time.monotonic() + 30)  # the late heartbeat's acknowledgement
        ended = time.monotonic()
        assert not keeper.expired(ended)  # what the agent used to look at: "not fenced"
        assert keeper.lapsed(started, ended)
        # an attempt that started after the lapse was never under it
        assert not keeper.lapsed(ended, time.monotonic())
    finally:
        proc.kill()
        proc.wait()
        keeper.close()


def test_no_lapse_while_renewals_come_in_time() -> None:
    keeper = FenceKeeper(None)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = time.monotonic()
        keeper.renew(started + 30)
        keeper.add(proc.pid, "task", 8)
        keeper.renew(time.monotonic() + 31)
        assert proc.poll() is None
        assert not keeper.lapsed(started, time.monotonic())
    finally:
        proc.kill()
        proc.wait()
        keeper.close()
