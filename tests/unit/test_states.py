"""The lifecycle's allowed transitions, checked on members and on the strings a report carries alike."""

from __future__ import annotations

import itertools

from podium.states import ALLOWED, TaskState, is_allowed


def test_is_allowed_says_the_same_of_a_state_and_of_its_value() -> None:
    for a, b in itertools.product(TaskState, repeat=2):
        assert is_allowed(a, b) == is_allowed(a.value, b.value) == is_allowed(a, b.value) == ((a, b) in ALLOWED)
    assert is_allowed("queued", "assigned") and is_allowed("running", "succeeded")
    assert not is_allowed("succeeded", "running") and not is_allowed("queued", "running")


def test_a_string_that_is_no_state_is_no_transition() -> None:
    assert not is_allowed("queued", "finished") and not is_allowed("Queued", "assigned") and not is_allowed("", "")
