"""The event hub's wake of log followers, without a database: a NOTIFY's payload wakes exactly the
followers of the tasks it names, a follower that leaves is forgotten, closing wakes everyone, and the
test-only backstop setting refuses what is not a duration."""

from __future__ import annotations

import uuid
from typing import Any, cast

import pytest

from podium.api import events
from podium.api.events import EventHub


def hub() -> EventHub:
    # the hub's reader is never started here: only the followers' side is exercised
    return EventHub(cast(Any, None), cast(Any, None))


async def test_a_payload_wakes_the_followers_of_the_tasks_it_names_and_no_others() -> None:
    h = hub()
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with h.log_follower(a) as a1, h.log_follower(a) as a2, h.log_follower(b) as b1:
        h._logs_written(f"{c},{a}")
        assert await a1.wait(0) and await a2.wait(0)
        assert not await b1.wait(0)
        # the wait cleared it: the next wait needs a new wake
        assert not await a1.wait(0)
        h._logs_written(str(b))
        assert await b1.wait(0) and not await a1.wait(0)
    assert h._followers == {}  # followers that left cost nothing afterwards


async def test_a_wake_between_a_read_and_the_wait_is_not_lost() -> None:
    h = hub()
    t = uuid.uuid4()
    with h.log_follower(t) as w:
        h._logs_written(str(t))  # arrives while the follower is still reading
        assert await w.wait(5)  # returns at once


async def test_closing_the_hub_wakes_every_follower() -> None:
    h = hub()
    with h.log_follower(uuid.uuid4()) as x, h.log_follower(uuid.uuid4()) as y:
        h.close()
        assert await x.wait(0) and await y.wait(0)
        assert h.closed


def test_the_backstop_comes_from_the_test_setting_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(events.LOG_BACKSTOP_ENV, raising=False)
    assert hub().log_backstop == events.LOG_BACKSTOP
    monkeypatch.setenv(events.LOG_BACKSTOP_ENV, "3600")
    assert hub().log_backstop == 3600.0
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv(events.LOG_BACKSTOP_ENV, bad)
        with pytest.raises(ValueError, match=f"{events.LOG_BACKSTOP_ENV}='{bad}' is not a number of seconds above 0"):
            hub()
