"""How the CLI shows what the server answers: `--json` prints the answer as JSON, otherwise a Rich
table whose cells are shown as they are (names, labels and reasons are user text, never markup);
timestamps are cut to what a terminal needs in one function (`when`). Nothing here talks to a server."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from podium.cli.base import err, out


class SafeTable(Table):
    """A table whose text cells are shown as they are: Rich would read `[/x]` in user text as
    markup (and fail, or drop it)."""

    def add_row(self, *cells: Any, **kw: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)


def when(ts: str | None, clock: bool = False) -> str:
    """An API timestamp (ISO 8601) as the CLI prints it: `2026-12-01 04:08:23`, or with `clock`
    the time of day to the millisecond (`04:08:23.512`); empty for none."""
    if not ts:
        return ""
    return ts[11:23] if clock else ts[:19].replace("T", " ")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None, no_wrap: Sequence[str] = ()) -> SafeTable:
    t = SafeTable(box=None, title=title, title_justify="left")
    for col in columns:
        t.add_column(col, no_wrap=col in no_wrap)
    for cells in rows:
        t.add_row(*cells)
    return t


def show(data: list[Any], json_out: bool, columns: Sequence[str], cells: Callable[[Any], Sequence[Any]],
         remaining: str = "0", no_wrap: Sequence[str] = ()) -> None:  # fmt: skip
    """The one way a command prints rows: JSON with --json, else a table of `cells(row)` per row;
    then, if the rows were cut short, a last line saying how many more there are."""
    if json_out:
        print_json(data)
    else:
        out.print(table(columns, (cells(r) for r in data), no_wrap=no_wrap))
    more(remaining, json_out)


def more(remaining: str, json_out: bool) -> None:
    """The last line of a listing cut short: how many rows it did not show, and how to see them."""
    if remaining == "0":
        return
    count = f"more than {int(remaining[:-1]):,}" if remaining.endswith("+") else f"{int(remaining):,}"
    line = f"… {count} more; use --all or --limit N"
    (err if json_out else out).print(line, markup=False, highlight=False)


def state(s: str) -> Text:
    color = {"succeeded": "green", "failed": "red", "lost": "red", "cancelled": "yellow", "running": "cyan"}.get(s)
    return Text(s, style=color or "")


def health(h: str) -> Text:
    color = {"online": "green", "unreachable": "yellow", "offline": "red"}.get(h)
    return Text(h, style=color or "")


def short_ids(ids: list[str], wide: bool) -> dict[str, str]:
    """Each id cut to 8 characters, or more where two shown ids would share it (as git does)."""
    if wide:
        return {i: i for i in ids}
    n = 8
    while n < max((len(i) for i in ids), default=0) and len({i[:n] for i in ids}) < len(set(ids)):
        n += 1
    return {i: i[:n] for i in ids}
