import dataclasses

import pytest

from podium.timing import COUNTS, DEFAULT_TIMING, FAST_TIMER_DIVISOR, timing_from_env


def test_defaults_are_the_seed_numbers() -> None:
    t = DEFAULT_TIMING
    assert (t.heartbeat, t.unreachable_after, t.offline_after) == (10, 30, 120)
    assert (t.provisioning_deadline, t.kill_grace, t.cancel_grace) == (15, 30, 60)


def test_fast_timers_divide_every_duration_but_not_the_counts() -> None:
    fast = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1"})
    assert FAST_TIMER_DIVISOR == 10
    for f in dataclasses.fields(fast):
        if f.name in COUNTS:
            assert getattr(fast, f.name) == getattr(DEFAULT_TIMING, f.name)
        else:
            assert getattr(fast, f.name) == getattr(DEFAULT_TIMING, f.name) / 10


def test_fast_timers_off_by_default_and_for_false_values() -> None:
    assert timing_from_env({}) == DEFAULT_TIMING
    assert timing_from_env({"PODIUM_TEST_FAST_TIMERS": "0"}) == DEFAULT_TIMING
    assert timing_from_env({"PODIUM_TEST_FAST_TIMERS": "true"}).offline_after == 12


def test_a_test_may_choose_a_gentler_divisor_and_a_bad_one_is_named() -> None:
    gentler = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1", "PODIUM_TEST_TIMER_DIVISOR": "3"})
    assert gentler.provisioning_deadline == DEFAULT_TIMING.provisioning_deadline / 3
    assert (gentler.claim_limit, gentler.place_limit) == (DEFAULT_TIMING.claim_limit, DEFAULT_TIMING.place_limit)
    # only with fast timers on: a production process never reads it
    assert timing_from_env({"PODIUM_TEST_TIMER_DIVISOR": "3"}) == DEFAULT_TIMING
    for bad in ("0", "fast", "-2", "nan"):
        with pytest.raises(ValueError, match="PODIUM_TEST_TIMER_DIVISOR"):
            timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1", "PODIUM_TEST_TIMER_DIVISOR": bad})
