"""What a `podium` command loads before it does anything: operators run these commands all day (and
the suite ~150 times), so the launchers' stack (server, agent, gRPC, PostgreSQL's driver, the web
framework), the spec models, YAML and the HTTP client are imported only by the commands that use
them. Each case runs the real command line in a fresh interpreter and reads its `sys.modules`:
deterministic, no timing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# What starts things: never loaded to list, parse or run an operator command.
LAUNCHER_STACK = (
    "podium.server", "podium.agent", "podium.store", "podium.api", "podium.gateway", "podium.scheduler",
    "grpc", "asyncpg", "fastapi", "starlette", "uvicorn", "psutil", "asyncio",
)  # fmt: skip
# httpx's own command line (click, pygments, rich's progress bars): the CLI never runs it.
HTTPX_CLI = ("httpx._main", "click", "pygments.lexers", "rich.progress", "rich.syntax")
# What only some commands need: talking to a server, reading a spec file, validating a spec.
CLIENT = ("podium.client", "httpx", "httpcore")
SPEC = ("podium.spec", "yaml")

# Runs `podium ARGS…` as `python -m podium` does, then writes to stderr, after a NUL, the exit code
# and the loaded modules (a None entry is a blocked import, not a loaded module).
_PROBE = """
import json, sys
sys.argv = ["podium", *sys.argv[1:]]
from podium.cli.main import main
code = 0
try:
    main()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
sys.stdout.flush()
sys.__stderr__.write("\\0" + json.dumps({"code": code, "modules": sorted(k for k, v in sys.modules.items() if v is not None)}))
"""


def _podium(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, set[str]]:
    """Exit code, stderr (what the command wrote there) and the modules loaded by `podium ARGS…`."""
    run = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120, env=env)
    stderr, _, probe = run.stderr.rpartition("\0")
    result = json.loads(probe)
    return result["code"], stderr, set(result["modules"])


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.fixture
def refused_addr() -> Iterator[str]:
    """An address that refuses connections at once: a port bound (so nobody else takes it) but not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("ls", "--help"),
        ("run", "--help"),
        ("submit", "--help"),
        ("spec", "put", "--help"),
        ("bench", "--help"),
        ("server", "--help"),
        ("agent", "--help"),
        ("dev", "--help"),
        ("db", "migrate", "--help"),
    ],
    ids=" ".join,
)
def test_help_loads_neither_the_launchers_stack_nor_the_client(args: tuple[str, ...]) -> None:
    code, stderr, modules = _podium(*args)
    assert (code, stderr) == (0, "")
    # (Typer's help renders with rich.syntax and pygments itself: only httpx's CLI is checked here)
    assert _loaded(modules, LAUNCHER_STACK + ("httpx._main", "click") + CLIENT + SPEC) == []


@pytest.mark.parametrize(
    "args",
    [("ls", "--server", "{addr}"), ("show", "t-1", "--server", "{addr}"), ("nodes", "--server", "{addr}"),
     ("run", "--server", "{addr}", "--detach", "--", "true")],
    ids=lambda a: a[0],
)  # fmt: skip
def test_an_operator_command_loads_the_client_only(args: tuple[str, ...], refused_addr: str) -> None:
    """It reaches for the server (refused here: its sentence, exit 1) with httpx, and nothing else heavy.
    `run` validates its spec locally first, so it alone loads the spec models (not YAML)."""
    code, stderr, modules = _podium(*(a.format(addr=refused_addr) for a in args))
    assert code == 1
    assert stderr.startswith(f"error: cannot reach the Podium server at {refused_addr}; is it running?"), stderr
    assert _loaded(modules, ("podium.client", "httpx")) != []
    assert _loaded(modules, LAUNCHER_STACK + HTTPX_CLI) == []
    assert ("podium.spec" in modules, "yaml" in modules) == (args[0] == "run", False)


class _Refuses401(BaseHTTPRequestHandler):
    """A server that refuses every token, as the API does: 401 and its sentence as JSON."""

    def do_GET(self) -> None:
        body = json.dumps({"error": "this token is not valid"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:  # the test's output is the CLI's, not this server's
        pass


def test_a_refusal_is_the_servers_sentence_with_the_token_hint() -> None:
    """The client's error is recognised without importing it up front: a 401 still ends as one line
    with the hint to set PODIUM_TOKEN, and exit code 1."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses401)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        addr = f"http://127.0.0.1:{srv.server_address[1]}"
        code, stderr, _ = _podium("ls", "--server", addr, env={**os.environ, "PODIUM_TOKEN": "wrong"})
    finally:
        srv.shutdown()
        srv.server_close()
    assert (code, stderr) == (1, "error: this token is not valid (set PODIUM_TOKEN to an operator token)\n")


def test_a_spec_file_is_read_and_validated_before_anything_is_sent(tmp_path: Path, refused_addr: str) -> None:
    """`submit` loads YAML and the spec models when it needs them, and a bad spec still fails locally
    with the field's sentence: the lazy imports changed nothing a user sees."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("command: [sleep, '1']\nresources: {cpu: -1}\n")
    code, stderr, modules = _podium("submit", str(bad), "--server", refused_addr)
    assert (code, stderr) == (1, "error: resources.cpu: CPU must be a non-negative amount, got -1\n")
    assert {"podium.spec", "yaml"} <= modules
    assert _loaded(modules, LAUNCHER_STACK + HTTPX_CLI) == []


@pytest.mark.parametrize(
    "args,sentence,stack",
    [
        (("server", "--placement", "nearest"), "error: --placement must be spread or binpack, not 'nearest'",
         {"podium.server", "podium.store", "asyncpg", "fastapi", "uvicorn", "grpc"}),
        (("agent", "--server", "127.0.0.1:1", "--backend", "vm"),
         "error: --backend 'vm' is not a backend; use --backend process and/or --backend container", {"podium.agent", "grpc"}),
    ],
    ids=["server", "agent"],
)
def test_the_launchers_load_their_stack_when_run(args: tuple[str, ...], sentence: str, stack: set[str]) -> None:
    """The launchers import what they start inside themselves, before they check their flags: a bad
    flag is refused (starting nothing) after the stack is loaded, so the imports are the ones they need."""
    code, stderr, modules = _podium(*args)
    assert (code, stderr) == (1, sentence + "\n")
    assert stack <= modules
