"""SQL lives in .sql files as named blocks (`-- name --` then the statement), loaded once.

A block whose name starts with `_` is a fragment, not a query: another block includes it as
`{{name: rows}}` (without the underscore), the fragment's `__ROWS__` replaced by `rows`. So a piece
of SQL several statements need (freeing an attempt's capacity) is written once. A fragment whose
statements number their parameters differently takes them as `{{name: $1 | $2}}`: `__1__`, `__2__`, …
replaced by each in turn.
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
        body = fragments[name].replace("__ROWS__", rows)
        for i, arg in enumerate(rows.split("|"), start=1):
            body = body.replace(f"__{i}__", arg.strip())
        return body

    def expanded(body: str) -> str:
        # a fragment may include another (the transitions' CTEs free capacity with `freed`)
        for _ in range(8):
            body, n = _INCLUDE.subn(include, body)
            if not n:
                return body
        raise RuntimeError("fragments include each other more than 8 deep")

    return {name: expanded(body) for name, body in blocks.items() if not name.startswith("_")}
