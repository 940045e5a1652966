"""The shape every scheduler loop has: do a pass when the database says something changed (a NOTIFY on
a channel) or when the tick passes, whichever comes first — written once.

A missed notification only delays: the tick is the backstop. A store that cannot be reached is
waited out (the subscription is taken again on the next pass); a pass never transitions anything from
memory, so running one again is always safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from podium.errors import StoreUnavailable
from podium.store import Store
from podium.store.db import CONNECTION_ERRORS

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
        self._wake = asyncio.Event()
        self._conn = None

    def wake(self) -> None:
        self._wake.set()

    async def _listen(self) -> None:
        if self._conn is None or self._conn.is_closed():
            self._conn = await self.store.listen(self.channel, lambda _payload: self._wake.set())

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def run(self) -> None:
        while True:
            again: float | None = None
            try:
                await self._listen()
                again = await self.run_pass()
            except StoreUnavailable as e:
                log.warning("%s: %s; retrying", self.name, e)
                await self._drop()
            except CONNECTION_ERRORS as e:
                log.warning("%s: lost the database (%s); retrying", self.name, e)
                await self._drop()
            if again is not None:
                if again > 0:
                    await asyncio.sleep(again)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick)
            self._wake.clear()

    async def close(self) -> None:
        await self._drop()
