"""The shape every scheduler loop has: do a pass when the database says something changed (a NOTIFY on
a channel) or when the tick passes, whichever comes first — written once.

A missed notification only delays: the tick is the backstop. Code in the same process wakes it with
`poke` (the dispatcher does, for a submission it was handed while idle). A store that cannot be reached is
waited out (the subscription is taken again on the next pass); a pass never transitions anything from
memory, so running one again is always safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from podium.errors import StoreUnavailable
from podium.store import Notification, Store, Subscription

log = logging.getLogger(__name__)

#: What a pass answers: how long until the next one — 0 at once (more is waiting), a number of
#: seconds to look again that soon, None at the next notification or tick.
Pass = Callable[[], Awaitable[float | None]]


class WokenLoop:
    def __init__(self, name: str, store: Store, channel: str, tick: float, run_pass: Pass) -> None:
        self.name = name
        self.store = store
        self.channel = channel
        self.tick = tick
        self.run_pass = run_pass
        self._sub: Subscription | None = None
        self._poked = asyncio.Event()
        self._not_before: float | None = None  # the next pass starts no sooner (`settle`)
        # between passes, waiting for a wake-up (not while a pass runs, nor while the store is down)
        self.idle = False
        # What woke the pass under way: the payloads of the notifications heard, when nothing else did
        # (None: the tick, a poke, or the last pass asked for this one). A pass may find in them that
        # it has nothing to look for (`Dispatcher._pass`).
        self.heard: frozenset[str] | None = None
        # The pass under way was woken by a poke or the tick with no notification heard since the last
        # pass: nothing committed meanwhile said anything (as far as this listener has heard yet).
        self.quiet = False

    async def _listen(self) -> None:
        if self._sub is None or self._sub.closed:
            self._sub = await self.store.listen(self.channel)

    async def _drop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.close()

    def nothing_pending(self) -> bool:
        """Whether this loop listens and has heard no notification it has not taken yet."""
        return self._sub is not None and not self._sub.closed and not self._sub.pending()

    def poke(self) -> None:
        """A pass now (or, if one is running, right after it), as a notification would bring; not held
        by `settle` (the caller waits for that pass)."""
        self.idle = False
        self._not_before = None
        self._poked.set()

    def settle(self, seconds: float) -> None:
        """The next pass starts no sooner than `seconds` from now, however soon it is woken: the
        wake-ups heard meanwhile are one pass's worth. Asked for by a pass that knows the next one
        has little to do until several changes have come (the dispatcher, when the fleet is full)."""
        self._not_before = asyncio.get_running_loop().time() + seconds

    async def _settled(self) -> None:
        not_before, self._not_before = self._not_before, None
        if not_before is None:
            return
        wait = not_before - asyncio.get_running_loop().time()
        if wait <= 0:
            return
        await asyncio.sleep(wait)
        if self._sub is not None:
            # heard before the pass starts, so committed before it reads: that pass sees them
            drained = self._sub.drain()
            self.quiet = self.quiet and not drained
            self._heard(drained)

    def _heard(self, notifications: list[Notification]) -> None:
        if self.heard is not None and notifications:
            self.heard = self.heard | {n.payload for n in notifications}

    async def _woken(self) -> None:
        """Until a notification (every one heard meanwhile counts as the same wake-up), a poke or the
        tick."""
        sub = self._sub
        if sub is None:
            await asyncio.sleep(self.tick)  # not listening (the store is down): the tick only
            return
        if self._poked.is_set():
            self._poked.clear()
            self.quiet = not sub.pending()
            return
        heard = asyncio.ensure_future(sub.get())
        poked = asyncio.ensure_future(self._poked.wait())
        self.idle = True
        try:
            await asyncio.wait((heard, poked), timeout=self.tick, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.idle = False
            heard.cancel()
            poked.cancel()
        poke = self._poked.is_set()
        self._poked.clear()
        failed = heard.exception() if heard.done() and not heard.cancelled() else None
        if isinstance(failed, StoreUnavailable):
            await self._drop()  # the next pass listens again
            return
        if failed is not None:
            raise failed
        if heard.done() and not heard.cancelled() and not poke:
            self.heard = frozenset({heard.result().payload})
        drained = sub.drain()
        self.quiet = not (heard.done() and not heard.cancelled()) and not drained
        self._heard(drained)

    async def run(self) -> None:
        while True:
            again: float | None = None
            try:
                await self._listen()
                again = await self.run_pass()
            except StoreUnavailable as e:
                log.warning("%s: %s; retrying", self.name, e)
                await self._drop()
            self.heard = None
            self.quiet = False
            if again is not None:
                if again > 0:
                    await asyncio.sleep(again)
                continue
            await self._woken()
            await self._settled()

    async def close(self) -> None:
        await self._drop()
