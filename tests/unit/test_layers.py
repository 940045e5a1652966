"""The rooms' "must never" (docs/architecture.md) that imports can show, checked on the source: a
change that breaks one fails here, naming the file and the import. (Placement's purity has its own
test in test_placement.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import podium

SRC = Path(podium.__file__).parent


def _imports(source: Path) -> list[str]:
    """Every module a file imports, functions' own imports included."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [f"{node.module}.{a.name}" for a in node.names] if node.module == "podium" else [node.module]
    return out


def _files(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (SRC / room).rglob("*.py") if "proto" not in p.parts)


def _offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{f.relative_to(SRC)} imports {name}"
        for f in files
        for name in _imports(f)
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    ]


def test_nothing_above_the_store_knows_the_driver() -> None:
    above = [p for p in SRC.rglob("*.py") if "store" not in p.relative_to(SRC).parts[:1] and "proto" not in p.parts]
    assert _offenders(above, ("asyncpg",)) == []


@pytest.mark.parametrize(
    "rooms,forbidden",
    [
        # the node decides nothing and reaches the server only over its stream
        (("agent",), ("podium.store", "podium.gateway", "podium.scheduler", "podium.api", "podium.server", "podium.cli")),
        # pure decisions: no I/O of any kind
        (("scheduler/policy.py",), ("podium.store", "podium.gateway", "podium.api", "asyncio", "grpc", "httpx")),
        # the client a user installs beside their own packages: HTTP only
        (("client.py",), ("podium.store", "podium.gateway", "podium.scheduler", "podium.api", "podium.cli", "podium.server")),
        # the store decides no policy and serves no protocol
        (("store",), ("podium.scheduler", "podium.gateway", "podium.api", "podium.cli", "grpc")),
    ],
)
def test_a_room_never_imports_what_it_must_never_use(rooms: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    files = [SRC / r for r in rooms if (SRC / r).is_file()] + _files(*(r for r in rooms if (SRC / r).is_dir()))
    assert files, rooms
    assert _offenders(files, forbidden) == []


def test_operator_commands_are_http_clients_only() -> None:
    """Every CLI module but the launchers talks to a server through podium.client, nothing else."""
    commands = [p for p in _files("cli") if p.name not in ("launch.py", "main.py")]
    assert _offenders(commands, ("podium.store", "podium.gateway", "podium.scheduler", "podium.api", "podium.server", "asyncpg")) == []


def _leaks(tp: object, where: str, seen: set[type]) -> list[str]:
    """Where a return type hands out something of the driver's: a Mapping (a record read by column
    name), a type of asyncpg's, or Any (anything at all) other than as a JSON document's values."""
    import dataclasses
    import typing
    from collections.abc import Mapping

    from podium.store.rows import Row

    if tp is typing.Any:
        return [f"{where} is Any"]
    origin = typing.get_origin(tp)
    if (getattr(origin or tp, "__module__", "") or "").startswith("asyncpg"):
        return [f"{where} is the driver's {tp}"]
    if origin is Mapping or tp is Mapping:
        return [f"{where} is a Mapping (a record read by column name), not one of store/rows.py's types"]
    if origin is not None:
        args = typing.get_args(tp)
        if origin is dict and len(args) == 2 and args[1] is typing.Any:
            return _leaks(args[0], f"{where}'s keys", seen)  # a JSON document's values are plain Python values
        return [problem for i, arg in enumerate(args) for problem in _leaks(arg, f"{where}[{i}]", seen)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp not in seen:
        seen.add(tp)
        if tp.__module__.startswith("podium.store") and not issubclass(tp, Row):  # NodeHello, Transition, …: what they carry
            hints = typing.get_type_hints(tp)
            return [p for f in dataclasses.fields(tp) for p in _leaks(hints[f.name], f"{where}.{f.name}", seen)]
    return []


def test_the_store_returns_its_own_row_types_not_driver_records() -> None:
    """Issue 12, rule 3: every public method of the store's classes returns rows.py's types or plain
    values; a method annotated to return a driver record (or a Mapping standing for one) fails here."""
    import inspect
    import typing

    from podium.store.db import Store
    from podium.store.reconcile import ReconcileStore
    from podium.store.ui import UiStore

    problems = []
    checked = 0
    for cls in (Store, UiStore, ReconcileStore):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            hints = typing.get_type_hints(fn)
            assert "return" in hints, f"{cls.__name__}.{name} has no return annotation"
            problems += _leaks(hints["return"], f"{cls.__name__}.{name}'s return", set())
            checked += 1
    assert checked > 60  # the check saw the store's methods, not an empty class
    assert problems == []


def test_the_leak_check_catches_a_driver_record() -> None:
    """The check above can fail: the ways a record used to leak are each caught."""
    from collections.abc import Mapping
    from typing import Any

    import asyncpg

    from podium.store.db import NodeHello
    from podium.store.rows import TaskRow

    assert _leaks(list[Mapping[str, Any]], "r", set())
    assert _leaks(tuple[asyncpg.Record, bool], "r", set())
    assert _leaks(Any, "r", set())
    assert _leaks(dict[str, Mapping[str, Any]], "r", set())
    assert _leaks(list[TaskRow] | None, "r", set()) == []
    assert _leaks(list[dict[str, Any]], "r", set()) == []  # a JSON document
    assert _leaks(NodeHello, "r", set()) == []  # a store dataclass is checked field by field
