"""freeze_startup: what startup left as garbage is freed, not frozen for the process's life; what
is alive is frozen (out of every later collection's sight); what is made later is collected as usual."""

from __future__ import annotations

import gc
import weakref

from podium.heap import freeze_startup


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_startup_garbage_is_freed_and_the_rest_frozen() -> None:
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
    assert any(o is kept for o in gc.get_objects())
