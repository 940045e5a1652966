"""Masking secret values in a task's output, also when a value is split across writes.

Per stream, the last `longest - 1` bytes are held back until the next chunk (or the end) shows they
are not the start of a secret, so no chunk that leaves the node ever carries a whole or a partial
secret that the next chunk would complete."""

from __future__ import annotations

MASK = b"********"


class Masker:
    def __init__(self, values: list[str]) -> None:
        # longest first, so a secret containing another is masked whole
        self.values = sorted({v.encode() for v in values if v}, key=len, reverse=True)
        self.hold = max((len(v) for v in self.values), default=1) - 1
        self._pending: dict[str, bytes] = {}

    def _mask(self, data: bytes) -> bytes:
        for v in self.values:
            data = data.replace(v, MASK)
        return data

    def feed(self, stream: str, data: bytes) -> bytes:
        """The bytes of `stream` that can be sent now, masked."""
        if not self.values:
            return data
        buf = self._mask(self._pending.get(stream, b"") + data)
        if self.hold == 0:
            self._pending[stream] = b""
            return buf
        # hold back only a tail that could still begin a secret
        cut = len(buf)
        for i in range(max(0, len(buf) - self.hold), len(buf)):
            tail = buf[i:]
            if any(v.startswith(tail) for v in self.values):
                cut = i
                break
        self._pending[stream] = buf[cut:]
        return buf[:cut]

    def flush(self, stream: str) -> bytes:
        rest = self._pending.pop(stream, b"")
        return self._mask(rest)
