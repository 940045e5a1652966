"""TCP proxies the harness controls, on an asyncio loop in a thread of their own: these kernels have
no netem, so delay, loss and partitions of a single link are made here. Every agent→replica link
and every replica→PostgreSQL link goes through one.

A cut link behaves like a partition, not like a refusal: bytes stop moving (held, not dropped) and
new connections hang, until the cut heals and everything resumes, as TCP would after a short
partition. Loss is modelled as TCP sees it: a lost segment is a retransmission stall. It must never
listen beyond the addresses the harness gives it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field


@dataclass
class Link:
    name: str
    target: tuple[str, int] | str  # host and port, or a Unix socket's path
    port: int = 0
    delay: float = 0.0
    loss: float = 0.0
    open: asyncio.Event = field(default_factory=asyncio.Event)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    server: asyncio.base_events.Server | None = None


class ProxyHub:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nemesis-proxy", daemon=True)
        self.thread.start()
        self.links: list[Link] = []

    def _call(self, coro: object, timeout: float = 10) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def add(self, name: str, listen_host: str, target: tuple[str, int] | str) -> Link:
        async def start() -> Link:
            link = Link(name, target)
            link.open.set()
            link.server = await asyncio.start_server(lambda r, w: self._serve(link, r, w), listen_host, 0)
            link.port = link.server.sockets[0].getsockname()[1]
            return link

        link = self._call(start())
        assert isinstance(link, Link)
        self.links.append(link)
        return link

    async def _serve(self, link: Link, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        link.writers.add(w)
        try:
            await link.open.wait()  # a connection opened during a cut hangs, as SYNs into a partition do
            if isinstance(link.target, str):
                ur, uw = await asyncio.open_unix_connection(link.target)
            else:
                ur, uw = await asyncio.open_connection(*link.target)
        except OSError:
            link.writers.discard(w)
            w.close()
            return
        link.writers.add(uw)
        await asyncio.gather(self._pipe(link, r, uw), self._pipe(link, ur, w), return_exceptions=True)
        for x in (w, uw):
            link.writers.discard(x)
            x.close()

    async def _pipe(self, link: Link, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                if not link.open.is_set():
                    await link.open.wait()
                if link.delay:
                    await asyncio.sleep(link.delay)
                if link.loss and self.rng.random() < link.loss:
                    await asyncio.sleep(self.rng.uniform(0.2, 1.0))  # a retransmission timeout
                w.write(data)
                await w.drain()
        finally:
            w.close()  # one side ended: end the other too, as a real connection would

    # ---- faults (callable from any thread) -------------------------------------------------------

    def cut(self, link: Link) -> None:
        self.loop.call_soon_threadsafe(link.open.clear)

    def heal(self, link: Link) -> None:
        link.delay = 0.0
        link.loss = 0.0
        self.loop.call_soon_threadsafe(link.open.set)

    def shape(self, link: Link, delay: float = 0.0, loss: float = 0.0) -> None:
        link.delay, link.loss = delay, loss

    def close(self) -> None:
        async def stop() -> None:
            for link in self.links:
                link.open.set()
                if link.server is not None:
                    link.server.close()
                for w in list(link.writers):
                    w.close()

        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()
