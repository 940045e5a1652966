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
