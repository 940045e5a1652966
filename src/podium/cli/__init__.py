"""The `podium` command line (Typer + Rich).

Every command pays for what its modules import before it does anything, and operators (and the test
suite, ~150 times) run them all day: each module here imports at its top only what listing its
commands needs; a command's own heavy imports (the server stack, the agent, pydantic's spec models,
YAML, the HTTP client) are made inside the function that uses them. tests/unit/test_cli_startup.py
checks what a command loads."""

import os as _os
import sys as _sys

# `podium dev` and `podium server` load gRPC before the agent package can say this (podium/agent/
# __init__.py): the processes they fork exec at once and never use gRPC, so its fork handlers only
# print "skipping fork() handlers" on the user's terminal.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# httpx's __init__ imports its own command line (httpx._main: click, pygments, rich.progress/syntax,
# ~0.1 s of CPU) whenever those are installed, which Typer makes them. This process never runs httpx's
# CLI: a None entry makes that import fail, and httpx falls back to the stub `main` it has for that
# case (`except ImportError` in httpx/__init__.py). Only this process is affected, and only if httpx
# is not loaded yet (an embedding program keeps its own httpx as it is).
if "httpx" not in _sys.modules:
    _sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
