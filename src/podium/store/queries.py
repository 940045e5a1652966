"""SQL lives in .sql files as named blocks (`-- name --` then the statement), loaded once.

A block whose name starts with `_` is a fragment, not a query: another block includes it as
`{{name: rows}}` (without the underscore), the fragment's `__ROWS__` replaced by `rows`. So a piece
of SQL several statements need (freeing an attempt's capacity) is written once.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- ([a-z_]+) --\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"\{\{([a-z_]+): ([^}]*)\}\}")


@cache
def queries() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for entry in sorted(resources.files("podium.store").joinpath("queries").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text()
        parts = _BLOCK.split(text)
        # parts: [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in blocks:
                raise RuntimeError(f"query {name!r} is defined twice")
            blocks[name] = body.strip()
    # a fragment's leading comment is its own documentation, not the including query's
    fragments = {
        name[1:]: "\n".join(line for line in body.splitlines() if not line.startswith("--")).strip()
        for name, body in blocks.items()
        if name.startswith("_")
    }

    def include(m: re.Match[str]) -> str:
        name, rows = m.group(1), m.group(2).strip()
        if name not in fragments:
            raise RuntimeError(f"a query includes {{{{{name}: …}}}}, but no fragment -- _{name} -- is defined")
        return fragments[name].replace("__ROWS__", rows)

    return {name: _INCLUDE.sub(include, body) for name, body in blocks.items() if not name.startswith("_")}
