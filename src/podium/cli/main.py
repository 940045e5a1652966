"""`podium`: run the server, an agent, or talk to a server.

The commands live by kind: podium.cli.launch starts things (server, agent, dev, db migrate); tasks,
specs, fleet and admin are HTTP clients of a server; render prints what they get back. This module
only gathers them and ends every command: an error is one line on stderr and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, TypeGuard

import typer
from rich.text import Text

if TYPE_CHECKING:
    from podium.client import PodiumError

# Importing a command module registers its commands on `app`, in the order `podium --help` lists them.
# isort: off
from podium.cli import launch, tasks, fleet, specs, admin, bench  # noqa: F401
# isort: on
from podium.cli.base import (  # noqa: F401 - the exit codes are this module's public names (tests import them here)
    EXIT_BUSY,
    EXIT_CANCELLED,
    EXIT_NO_RUNNER,
    EXIT_OTHER,
    EXIT_REFUSED,
    EXIT_SUPERSEDED,
    EXIT_TIMEOUT,
    CliError,
    app,
    err,
)  # fmt: skip


def _error(message: str) -> None:
    """`error: …` on stderr: the message is server or user text, shown as it is, never as markup."""
    err.print(Text.assemble(("error:", "red"), " ", message), highlight=False)


def main() -> None:
    try:
        _main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the last word: even printing an error must not end in a traceback
        if os.environ.get("PODIUM_DEBUG") == "1":
            raise
        sys.stderr.write(f"error: {type(e).__name__}: {e} (PODIUM_DEBUG=1 shows the traceback)\n")
        sys.exit(1)


def _is_usage_error(e: Exception) -> bool:
    """Click's usage errors, or those of the copy of click that Typer carries: they print themselves."""
    import click

    kinds: list[type[Exception]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as TyperClickException

        kinds.append(TyperClickException)
    except ImportError:  # a Typer that uses click itself
        pass
    return isinstance(e, tuple(kinds))


def _is_podium_error(e: Exception) -> TypeGuard[PodiumError]:
    """A `podium.client.PodiumError`, asked without importing the client (httpx) for a command that
    never used it: if the module is not loaded, nothing raised one."""
    client = sys.modules.get("podium.client")
    return client is not None and isinstance(e, client.PodiumError)


def _main() -> None:
    """Every way a command can end, as one line and an exit code; PODIUM_DEBUG=1 keeps tracebacks."""
    debug = os.environ.get("PODIUM_DEBUG") == "1"
    try:
        rc = app(standalone_mode=False)
        # with standalone_mode off, click hands back typer.Exit's code instead of exiting
        sys.exit(rc if isinstance(rc, int) else 0)
    except CliError as e:
        _error(str(e))
        sys.exit(e.code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(EXIT_CANCELLED)
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)
    except Exception as e:  # click's usage errors and anything unforeseen: one line, no traceback
        if _is_podium_error(e):  # the server refused, or could not be reached: its sentence, as it is
            _error(str(e) + (" (set PODIUM_TOKEN to an operator token)" if e.status == 401 else ""))
            sys.exit(1)
        if _is_usage_error(e):
            e.show()  # type: ignore[attr-defined]
            sys.exit(e.exit_code)  # type: ignore[attr-defined]
        if debug:
            raise
        _error(f"{type(e).__name__}: {e} (PODIUM_DEBUG=1 shows the traceback)")
        sys.exit(1)
