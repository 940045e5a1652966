"""freeze_startup: what startup left as garbage is freed, not frozen for the process's life; what
is alive is frozen (out of every later collection's sight); what is made later is collected as usual,
once the young generation has grown to YOUNG objects."""

from __future__ import annotations

import gc
import weakref

from podium.heap import YOUNG, freeze_startup


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_startup_garbage_is_freed_and_the_rest_frozen() -> None:
    threshold = gc.get_threshold()
    kept = _Cycle()
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup()
        assert gone() is None  # a cycle only the collector frees: freed before the freeze
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen: no generation holds it
        later = _Cycle()
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None  # made after the freeze: collected as usual
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert any(o is kept for o in gc.get_objects())


def test_a_young_collection_waits_for_young_objects() -> None:
    """Objects that live a little while (a report waiting for its commit, an Assign for its write) are
    not collected, and promoted towards the oldest generation, every 700 allocations: a server whose
    fleet holds half a million objects walked them all every second or so."""
    threshold = gc.get_threshold()
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    try:
        freeze_startup()
        assert gc.get_threshold()[1:] == threshold[1:]  # the older generations' thresholds as they were
        gc.callbacks.append(count)
        alive = [[] for _ in range(YOUNG // 2)]  # with Python's default threshold (700): 7 collections
        assert len(alive) == YOUNG // 2 and started == []
        more = [[] for _ in range(YOUNG)]
        assert more and started  # once past YOUNG, collected as usual
    finally:
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        gc.unfreeze()
        gc.set_threshold(*threshold)
