"""The shape every scheduler loop has: do a pass when the database says something changed (a NOTIFY on
a channel) or when the tick passes, whichever comes first — written once.

A missed notification only delays: the tick is the backstop. A store that cannot be reached is
waited out (the subscription is taken again on the next pass); a pass never transitions anything from
memory, so running one again is always safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from podium.errors import StoreUnavailable
from podium.store import Store, Subscription

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

    async def _listen(self) -> None:
        if self._sub is None or self._sub.closed:
            self._sub = await self.store.listen(self.channel)

    async def _drop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.close()

    async def _woken(self) -> None:
        """Until a notification (every one heard meanwhile counts as the same wake-up) or the tick."""
        sub = self._sub
        if sub is None:
            await asyncio.sleep(self.tick)  # not listening (the store is down): the tick only
            return
        try:
            await asyncio.wait_for(sub.get(), timeout=self.tick)
        except TimeoutError:
            return
        except StoreUnavailable:
            await self._drop()  # the next pass listens again
            return
        sub.drain()

    async def run(self) -> None:
        while True:
            again: float | None = None
            try:
                await self._listen()
                again = await self.run_pass()
            except StoreUnavailable as e:
                log.warning("%s: %s; retrying", self.name, e)
                await self._drop()
            if again is not None:
                if again > 0:
                    await asyncio.sleep(again)
                continue
            await self._woken()

    async def close(self) -> None:
        await self._drop()
