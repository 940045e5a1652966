"""SQL lives in .sql files as named blocks (`-- name --` then the statement), loaded once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- ([a-z_]+) --\s*$", re.MULTILINE)


@cache
def queries() -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in sorted(resources.files("podium.store").joinpath("queries").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text()
        parts = _BLOCK.split(text)
        # parts: [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in out:
                raise RuntimeError(f"query {name!r} is defined twice")
            out[name] = body.strip()
    return out
